# One job per shard takes its slice of the prompt list and generates its answers: a separate
# slicing job would be a cluster job per shard for a millisecond's work, and 1 of 5 jobs planned.
# Generation does HTTP only, so it runs where Snakemake runs, whatever the executor: there, every
# shard job at once shares one cap per endpoint (max_concurrency, held by lock files), and the
# free slots of a shard's last requests serve the next shard's prompts.
localrules:
    generate_responses,


rule generate_responses:
    input:
        prompts=run_path("prompts/all.parquet"),
        probe=run_path("probe.json"),
    output:
        prompts=run_path("prompts/{shard}.parquet"),
        raw=run_path("raw/{shard}.parquet"),
    log:
        **get_server_logs(generate=get_log("generate_responses", per_shard=True)),
        # How busy each endpoint was while the job ran, which the report merges over shards: a
        # log, so a missing one (a run from before it existed) reruns nothing.
        activity=get_activity_log(),
    benchmark:
        bench_path("generate/{shard}.tsv")
    conda:
        "../envs/eaglenest.yaml"
    threads: get_generate_threads()
    resources:
        endpoint_slots=1,
    params:
        # The shard's rows of the list: raising max_samples reruns only a shard whose slice grew.
        bounds=lambda wc: shard_params_json(PROMPT_OPTIONS, wc.shard),
        # The journal lives outside the outputs so a failed or killed job never loses it.
        journal=run_path("journal/generate/{shard}.jsonl"),
        # The prompt options the shard is sliced with, and checked against all.parquet's stamp:
        # `bounds` and the input all.parquet already track what of them shapes the shard.
        prompts=untracked(PROMPT_OPTIONS.to_json()),
        # Only what shapes the request body reruns generation (not concurrency, timeouts, URLs).
        settings=settings_json(RequestSettings),
        client=untracked(settings_json(GenerationClientSettings)),
        code_version=code_version("generate"),
    script:
        "../scripts/generate.py"
