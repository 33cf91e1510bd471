# Frame datasets (and recall tables, attention stores) -> figures per run and across runs, as the
# figure registry (sinkscope/analysis/figures.py) declares them: file names, captions, layers.
# Every figure is marked for the Snakemake report (`snakemake --report report.html`): category
# "Figures", one subcategory per run and one across runs, labels `figure` and `layer` (0-based).


rule figures:
    input:
        frames=expand(
            "results/frames/{{checkpoint}}/{{prompt}}/layer{layer}.zarr",
            layer=RUN_FIGURE_LAYERS,
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
            for figure in RUN_FIGURES + POLICY_FIGURES
        ],
    log:
        "results/logs/figures/{checkpoint}/{prompt}.log",
    conda:
        "../envs/analysis.yaml"
    params:
        figures=canonical(config["figures"]),
        policies=canonical(config["policies"]),
    script:
        "../scripts/figures.py"


rule compare_figures:
    input:
        frames=expand(
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


if SURVEY_LAYERS:

    rule survey_figures:
        input:
            frames=expand(
                "results/frames/{{checkpoint}}/{{prompt}}/layer{layer}.zarr",
                layer=SURVEY_LAYERS,
            ),
            attention=expand(
                "results/attention/{{checkpoint}}/{{prompt}}/layer{layer}.zarr",
                layer=SURVEY_LAYERS,
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
                for figure in SURVEY_FIGURES
            ],
        log:
            "results/logs/figures/{checkpoint}/{prompt}.survey.log",
        conda:
            "../envs/analysis.yaml"
        params:
            figures=canonical(config["figures"]),
            stats=canonical(config["stats"]),
        script:
            "../scripts/figures.py"

    rule compare_survey_figures:
        input:
            frames=expand(
                "results/frames/{checkpoint}/{prompt}/layer{layer}.zarr",
                checkpoint=CHECKPOINTS,
                prompt=PROMPTS,
                layer=SURVEY_LAYERS,
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
                for figure in SURVEY_COMPARE_FIGURES
            ],
        log:
            "results/logs/figures/compare.survey.log",
        conda:
            "../envs/analysis.yaml"
        params:
            figures=canonical(config["figures"]),
            stats=canonical(config["stats"]),
        script:
            "../scripts/figures.py"

    localrules:
        survey_figures,
        compare_survey_figures,
