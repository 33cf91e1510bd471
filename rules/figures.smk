# Frame datasets (and recall tables, attention stores) -> figures per run and across runs, as the
# figure registry (sinkscope/analysis/figures.py) declares them: file names, captions, layers.
# One job per run draws its layer, run, policy and survey figures, and rule summary the figures
# across runs (fewer, larger jobs: most of a figure job is Python and matplotlib start-up).
# Every figure is marked for the Snakemake report (`snakemake --report report.html`): category
# "Figures", one subcategory per run and one across runs, labels `figure` and `layer` (0-based).


rule figures:
    input:
        frames=expand(
            "results/frames/{{checkpoint}}/{{prompt}}/layer{layer}.zarr",
            layer=sorted(set(RUN_FIGURE_LAYERS) | set(SURVEY_LAYERS)),
        ),
        attention=expand(
            "results/attention/{{checkpoint}}/{{prompt}}/layer{layer}.zarr",
            layer=SURVEY_LAYERS,
        ),
        policies="results/policies/{checkpoint}/{prompt}.csv",
    output:
        [
            report(
                figure.path,
                caption=f"../report/{figure.kind.caption}",
                category="Figures",
                subcategory="{checkpoint} / {prompt}",
                labels=figure.labels,
            )
            for figure in RUN_FIGURES + POLICY_FIGURES + SURVEY_FIGURES
        ],
    log:
        "results/logs/figures/{checkpoint}/{prompt}.log",
    # The longest of the last jobs: started before the short ones, which then fill the gaps.
    priority: 1
    conda:
        "../envs/analysis.yaml"
    params:
        figures=canonical(config["figures"]),
        policies=canonical(config["policies"]),
        stats=canonical(config["stats"]),
        figure_layers=RUN_FIGURE_LAYERS,
        survey_layers=SURVEY_LAYERS,
    script:
        "../scripts/figures.py"
