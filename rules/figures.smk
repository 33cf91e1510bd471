# Frame datasets -> figures per run and across runs, as the figure registry
# (sinkscope/analysis/figures.py) declares them: file names, captions, the layers each shows.
# Every figure is marked for the Snakemake report (`snakemake --report report.html`): category
# "Figures", one subcategory per run and one across runs, labels `figure` and `layer` (0-based).


rule figures:
    input:
        expand(
            "results/frames/{{checkpoint}}/{{prompt}}/layer{layer}.zarr",
            layer=LAYERS,
        ),
    output:
        [
            report(
                figure.path,
                caption=f"../report/{figure.kind.caption}",
                category="Figures",
                subcategory="{checkpoint} / {prompt}",
                labels=figure.labels,
            )
            for figure in RUN_FIGURES
        ],
    log:
        "results/logs/figures/{checkpoint}/{prompt}.log",
    conda:
        "../envs/analysis.yaml"
    params:
        figures=canonical(config["figures"]),
    script:
        "../scripts/figures.py"


rule compare_figures:
    input:
        expand(
            "results/frames/{checkpoint}/{prompt}/layer{layer}.zarr",
            checkpoint=CHECKPOINTS,
            prompt=PROMPTS,
            layer=HEAD_LAYERS,
        ),
    output:
        [
            report(
                figure.path,
                caption=f"../report/{figure.kind.caption}",
                category="Figures",
                subcategory="across checkpoints and prompts",
                labels=figure.labels,
            )
            for figure in COMPARE_FIGURES
        ],
    log:
        "results/logs/figures/compare.log",
    conda:
        "../envs/analysis.yaml"
    params:
        figures=canonical(config["figures"]),
    script:
        "../scripts/figures.py"
