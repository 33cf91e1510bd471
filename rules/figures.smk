# Frame datasets -> SVG figures per run and across runs. Every figure is marked for the
# Snakemake report (`snakemake --report report.html`): category "Figures", one subcategory per
# run and one across runs, labels `figure` and `layer` (1-based, as the figures count), and the
# caption of its kind from report/.

LAYER_FIGURES = ["heads_grid", "heads_heatmap", "frame_maps"]
RUN_FIGURES = ["layer_comparison", "statistics"]
COMPARE_KINDS = ["checkpoints", "prompts", "passes"]
RUN_SUBCATEGORY = "{checkpoint} / {prompt}"
# `layer` labels of the figures that span layers: all captured ones, or those of figures.heads.
HEAD_LAYERS = sorted({layer for layer, _ in config["figures"]["heads"]})
ALL_LAYERS_LABEL = ", ".join(f"L{layer + 1}" for layer in LAYERS)
HEAD_LAYERS_LABEL = ", ".join(f"L{layer + 1}" for layer in HEAD_LAYERS)


rule figures:
    input:
        expand(
            "results/frames/{{checkpoint}}/{{prompt}}/layer{layer}.zarr",
            layer=LAYERS,
        ),
    output:
        # figure4 first: the script writes into the folder of output[0].
        report(
            f"results/figures/{{checkpoint}}/{{prompt}}/figure4.{FIGURE_FORMAT}",
            caption="../report/figure4.rst",
            category="Figures",
            subcategory=RUN_SUBCATEGORY,
            labels={"figure": "figure4", "layer": HEAD_LAYERS_LABEL},
        ),
        # One report() per file, so that each carries its own layer label.
        [
            report(
                f"results/figures/{{checkpoint}}/{{prompt}}/layer{layer}_{kind}.{FIGURE_FORMAT}",
                caption=f"../report/{kind}.rst",
                category="Figures",
                subcategory=RUN_SUBCATEGORY,
                labels={"figure": kind.replace("_", " "), "layer": f"L{layer + 1}"},
            )
            for layer in LAYERS
            for kind in LAYER_FIGURES
        ],
        [
            report(
                f"results/figures/{{checkpoint}}/{{prompt}}/{kind}.{FIGURE_FORMAT}",
                caption=f"../report/{kind}.rst",
                category="Figures",
                subcategory=RUN_SUBCATEGORY,
                labels={"figure": kind.replace("_", " "), "layer": ALL_LAYERS_LABEL},
            )
            for kind in RUN_FIGURES
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
        # The files of COMPARE_FIGURES (rule all), each with its caption.
        [
            report(
                f"results/figures/compare/{kind}.{FIGURE_FORMAT}",
                caption=f"../report/compare_{kind}.rst",
                category="Figures",
                subcategory="across checkpoints and prompts",
                labels={"figure": kind, "layer": HEAD_LAYERS_LABEL},
            )
            for kind in COMPARE_KINDS
        ],
    log:
        "results/logs/figures/compare.log",
    conda:
        "../envs/analysis.yaml"
    params:
        figures=canonical(config["figures"]),
    script:
        "../scripts/compare_figures.py"
