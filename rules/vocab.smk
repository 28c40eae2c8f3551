# The draft vocabulary: the target ids the drafter predicts, from every shard's token counts.


rule build_draft_vocab:
    input:
        counts=expand(run_path("tokens/{shard}.counts.safetensors"), shard=SHARDS),
    output:
        vocab=run_path("vocab/draft_vocab.safetensors"),
        summary=run_path("vocab/draft_vocab.json"),
    log:
        get_log("build_draft_vocab"),
    conda:
        "../envs/eaglenest.yaml"
    threads: 1
    params:
        settings=settings_json(VocabSettings),
        code_version=code_version("build_draft_vocab"),
    script:
        "../scripts/build_draft_vocab.py"
