# Everything the DAG made about attention -> one page to walk it (results/explorer/index.html,
# opened from the file system): every surveyed run's layers, heads, passes and frames, and the
# closed loops' rollouts frame by frame beside their videos. sinkscope.analysis.explorer;
# docs/GUIDE.md, "The attention explorer".


rule explorer:
    input:
        # the surveyed layers (every pass of capture.passes), else the token layers: a page
        # walks layers that share their passes
        frames=expand(
            "results/frames/{checkpoint}/{prompt}/layer{layer}.zarr",
            checkpoint=CHECKPOINTS,
            prompt=PROMPTS,
            layer=SURVEY_LAYERS or LAYERS,
        ),
        attention=expand(
            "results/attention/{checkpoint}/{prompt}/layer{layer}.zarr",
            checkpoint=CHECKPOINTS,
            prompt=PROMPTS,
            layer=SURVEY_LAYERS,
        ),
        deviation=[
            f"results/closed_loop/{checkpoint}/{prompt}/{rollout}.csv"
            for checkpoint, prompt in CLOSED_LOOP_RUNS
            for rollout in CLOSED_LOOP_ROLLOUTS
        ],
        blocks="results/closed_loop/blocks.csv" if CLOSED_LOOP_POLICIES else [],
        slots=[
            f"results/closed_loop/{checkpoint}/{prompt}/{rollout}/layer{layer}.zarr"
            for checkpoint, prompt in CLOSED_LOOP_RUNS
            for rollout in CLOSED_LOOP_ROLLOUTS
            for layer in CLOSED_LOOP_SURVEY
        ],
        metrics=[
            f"results/videos/{checkpoint}/{prompt}/metrics.csv"
            for checkpoint, prompt in VIDEO_RUNS
        ],
        videos=[
            f"results/videos/{checkpoint}/{prompt}/{rollout}.mp4"
            for checkpoint, prompt in VIDEO_RUNS
            for rollout in CLOSED_LOOP_ROLLOUTS
        ],
    output:
        # not embedded in the report (a pure HTML report takes no folder): its front page links
        # to results/explorer/index.html (report/workflow.rst)
        directory("results/explorer"),
    log:
        "results/logs/explorer.log",
    conda:
        "../envs/analysis.yaml"
    params:
        stats=canonical(config["stats"]),
    script:
        "../scripts/explorer.py"
