# Frame datasets -> tidy statistics (Contract 3), one job per run (every layer: seconds); the
# summary tables (statistics, sink rate, policy recall) go into the report.


rule stats:
    input:
        expand(
            "results/frames/{{checkpoint}}/{{prompt}}/layer{layer}.zarr", layer=LAYERS
        ),
    output:
        expand("results/stats/{{checkpoint}}/{{prompt}}/layer{layer}.csv", layer=LAYERS),
    log:
        "results/logs/stats/{checkpoint}/{prompt}.log",
    # Tables before the figures that read them: the last jobs then run side by side.
    priority: 1
    conda:
        "../envs/analysis.yaml"
    params:
        stats=canonical(config["stats"]),
    script:
        "../scripts/stats.py"


rule summary:
    input:
        stats=expand(
            "results/stats/{checkpoint}/{prompt}/layer{layer}.csv",
            checkpoint=CHECKPOINTS,
            prompt=PROMPTS,
            layer=LAYERS,
        ),
        policies=expand(
            "results/policies/{checkpoint}/{prompt}.csv",
            checkpoint=CHECKPOINTS,
            prompt=PROMPTS,
        ),
    output:
        summary=report(
            "results/stats/summary.csv",
            caption="../report/summary.rst",
            category="Sink statistics",
            subcategory="all runs",
            labels={"table": "summary (csv)"},
        ),
        summary_table=report(
            "results/stats/summary.html",
            caption="../report/summary.rst",
            category="Sink statistics",
            subcategory="all runs",
            labels={"table": "summary"},
        ),
        sink_rate=report(
            "results/stats/sink_rate.csv",
            caption="../report/sink_rate.rst",
            category="Sink statistics",
            subcategory="all runs",
            labels={"table": "sink rate"},
        ),
        policies=report(
            "results/policies/summary.csv",
            caption="../report/policy_summary.rst",
            category="KV-cache policies",
            subcategory="all runs",
            labels={"table": "policy recall (csv)"},
        ),
    log:
        "results/logs/summary.log",
    conda:
        "../envs/analysis.yaml"
    params:
        sink_threshold=config["stats"]["sink_threshold"],
    script:
        "../scripts/summary.py"
