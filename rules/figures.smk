# Frame datasets -> SVG figures per run and across runs.


rule figures:
    input:
        expand(
            "results/frames/{{checkpoint}}/{{prompt}}/layer{layer}.zarr",
            layer=LAYERS,
        ),
    output:
        f"results/figures/{{checkpoint}}/{{prompt}}/figure4.{FIGURE_FORMAT}",
        expand(
            "results/figures/{{checkpoint}}/{{prompt}}/layer{layer}_{kind}.{fmt}",
            layer=LAYERS,
            kind=["heads_grid", "heads_heatmap", "frame_maps"],
            fmt=FIGURE_FORMAT,
        ),
        expand(
            "results/figures/{{checkpoint}}/{{prompt}}/{kind}.{fmt}",
            kind=["layer_comparison", "statistics"],
            fmt=FIGURE_FORMAT,
        ),
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
            layer=sorted({layer for layer, _ in config["figures"]["heads"]}),
        ),
    output:
        COMPARE_FIGURES,
    log:
        "results/logs/figures/compare.log",
    conda:
        "../envs/analysis.yaml"
    params:
        figures=canonical(config["figures"]),
    script:
        "../scripts/compare_figures.py"
