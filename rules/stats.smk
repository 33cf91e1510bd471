# Every run's frame datasets and recall tables -> tidy statistics (Contract 3) of every run and
# layer, the summary tables (statistics, sink rate, policy recall) and the figures across runs
# (which read the same statistics): one job, since a run's statistics take well under a second
# and a job of its own would spend most of its time starting Python. Only this job reads the
# per-run CSVs, so recomputing every run's for a new prompt reruns nothing else; a new figure
# option recomputes the tables (seconds).


rule summary:
    input:
        frames=expand(
            "results/frames/{checkpoint}/{prompt}/layer{layer}.zarr",
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
        # in the order of the frame datasets
        stats=expand(
            "results/stats/{checkpoint}/{prompt}/layer{layer}.csv",
            checkpoint=CHECKPOINTS,
            prompt=PROMPTS,
            layer=LAYERS,
        ),
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
        figures=[
            report(
                figure.path,
                caption=f"../report/{figure.kind.caption}",
                category="Figures",
                subcategory="across checkpoints and prompts",
                labels=figure.labels,
            )
            for figure in COMPARE_FIGURES + SURVEY_COMPARE_FIGURES
        ],
    log:
        "results/logs/summary.log",
    # Among the longest of the last jobs, as figures: started before the short ones (explorer,
    # video_summary), which then fill the gaps instead of leaving it to run alone at the end.
    priority: 1
    conda:
        "../envs/analysis.yaml"
    params:
        stats=canonical(config["stats"]),
        figures=canonical(config["figures"]),
        figure_layers=HEAD_LAYERS,
        survey_layers=SURVEY_LAYERS,
    script:
        "../scripts/summary.py"
