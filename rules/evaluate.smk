# The run's plain decoding in vLLM (evaluate.engine: vllm): the held-out prompts, depth cuts, the
# other thinking mode's prompts and the sets decoded by the target alone, once for every
# evaluate_drafter (one per family) and evaluate_compare job. No drafter and no K among its inputs
# and params: it runs beside training, and neither a family's training nor evaluate.ks reruns it.
rule decode_plain:
    input:
        tokens=expand(run_path("tokens/{shard}.parquet"), shard=EVAL_SHARDS),
        target=get_target_dir(),
        sets=get_decoded_sets(),
    output:
        # requested by the evaluations with evaluate.engine vllm only (get_plain_decoding)
        plain=PLAIN_DECODING,
    log:
        get_log("decode_plain"),
    benchmark:
        bench_path("evaluate/decode_plain.tsv")
    conda:
        "../envs/eaglenest.yaml"
    threads: 2
    resources:
        gpu=get_evaluate_gpus(),
    params:
        settings=settings_json(PlainSettings),
        runtime=untracked(settings_json(VllmRuntime)),
        sets=get_set_decoding(),
        thinking=settings_json(ThinkingSettings),
        code_version=code_version("decode_plain"),
    script:
        "../scripts/decode_plain.py"


rule evaluate_drafter:
    input:
        # One job per family of train.families: eval/ for EAGLE-3, eval_p_eagle/, eval_dflash/.
        drafter=run_path("drafter{family_suffix}/config.json"),
        weights=run_path("drafter{family_suffix}/model.safetensors"),
        hidden=get_hidden_files(EVAL_SHARDS),
        tokens=expand(run_path("tokens/{shard}.parquet"), shard=EVAL_SHARDS),
        head=run_path("hidden/target_head.safetensors"),
        vocab=run_path("vocab/draft_vocab.safetensors"),
        target=get_target_dir(),
        # evaluate.sets, decoded by the vLLM engines (none without evaluate.engine: vllm)
        sets=get_decoded_sets(),
        # the drafter's training tokens: the thinking mode it was trained in
        train_tokens=expand(run_path("tokens/{shard}.parquet"), shard=TRAIN_SHARDS),
        # with evaluate.engine vllm: the run's plain decoding (decode_plain), no engine of its own
        plain=get_plain_decoding(),
    output:
        metrics=run_path("eval{family_suffix}/metrics.json"),
    log:
        get_log("evaluate_drafter{family_suffix}"),
    benchmark:
        bench_path("evaluate/evaluate_drafter{family_suffix}.tsv")
    conda:
        "../envs/eaglenest.yaml"
    threads: 2
    resources:
        gpu=get_evaluate_gpus(),
    params:
        # EAGLE-3's: every evaluate.ks; another family's: the K it is measured at
        settings=get_evaluate_settings(settings_json(EvaluateSettings)),
        hidden=get_store_params(),
        runtime=untracked(settings_json(VllmRuntime)),
        family=get_family,
        sets=get_set_decoding(),
        thinking=settings_json(ThinkingSettings),
        code_version=code_version("evaluate_drafter"),
    script:
        "../scripts/evaluate_drafter.py"


# A drafter trained elsewhere (evaluate.compare): decoded in vLLM on the prompts, depths, sets and
# K of the run's own, by a job of its own (one added reruns nothing else).
rule evaluate_compare:
    input:
        drafter=get_compared_files,
        tokens=expand(run_path("tokens/{shard}.parquet"), shard=EVAL_SHARDS),
        target=get_target_dir(),
        sets=get_decoded_sets(),
        plain=get_plain_decoding(),
    output:
        metrics=run_path("eval_compare/{compare}.json"),
    log:
        get_log("evaluate_compare/{compare}"),
    benchmark:
        bench_path("evaluate/evaluate_compare/{compare}.tsv")
    wildcard_constraints:
        compare=COMPARE_NAMES,
    conda:
        "../envs/eaglenest.yaml"
    threads: 2
    resources:
        gpu=get_evaluate_gpus(),
    params:
        settings=settings_json(CompareSettings),
        runtime=untracked(settings_json(VllmRuntime)),
        drafter=get_compared_dir,
        sets=get_set_decoding(),
        # the other thinking mode's prompts: part of the plain decoding's request it checks
        thinking=settings_json(ThinkingSettings),
        code_version=code_version("evaluate_compare"),
    script:
        "../scripts/evaluate_compare.py"
