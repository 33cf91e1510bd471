# Videos (`videos`): the rollouts decoded with Wan's VAE, one latent frame at a time. Per
# closed-loop run one GPU job decodes every rollout (the full cache's first) into an mp4 each, a
# grid of them and the pixel-space diagnostics per frame; with `videos: all` one more per run
# decodes its survey rollout. A local job stacks the tables (results/videos/metrics.csv,
# drift.csv) and draws the video figures of every closed-loop run.


rule videos:
    input:
        vae=vae_files_input,
        latents=[
            f"results/closed_loop/{{checkpoint}}/{{prompt}}/{rollout}.safetensors"
            for rollout in CLOSED_LOOP_ROLLOUTS
        ],
        tables=[
            f"results/closed_loop/{{checkpoint}}/{{prompt}}/{rollout}.csv"
            for rollout in CLOSED_LOOP_ROLLOUTS
        ],
    output:
        videos=[
            f"results/videos/{{checkpoint}}/{{prompt}}/{rollout}.mp4"
            for rollout in CLOSED_LOOP_ROLLOUTS
        ],
        grid="results/videos/{checkpoint}/{prompt}/grid.mp4",
        metrics="results/videos/{checkpoint}/{prompt}/metrics.csv",
    log:
        "results/logs/videos/{checkpoint}/{prompt}.log",
    # Next on the GPU once its rollouts are there: the longest chain (the video summary waits).
    priority: 3
    conda:
        "../envs/extract.yaml"
    threads: EXTRACT_THREADS
    resources:
        gpu=GPU_PER_JOB,
        mem_mb=DECODE_MEM_MB,
        runtime=video_runtime(
            config, len(CLOSED_LOOP_ROLLOUTS), config["closed_loop"]["num_frames"]
        ),
    params:
        rollouts=CLOSED_LOOP_ROLLOUTS,
        vae=lambda wildcards: vae_path(config, wildcards.checkpoint),
        settings={"device": config["device"], "dtype": config["dtype"]},
        sink_frames=config["closed_loop"].get("sink_frames", 0),
    script:
        "../scripts/videos.py"


rule survey_video:
    input:
        vae=vae_files_input,
        latents="results/attention/{checkpoint}/{prompt}/latents.safetensors",
    output:
        videos="results/videos/{checkpoint}/{prompt}/survey.mp4",
        metrics="results/videos/{checkpoint}/{prompt}/survey.metrics.csv",
    log:
        "results/logs/videos/{checkpoint}/{prompt}.survey.log",
    conda:
        "../envs/extract.yaml"
    threads: EXTRACT_THREADS
    resources:
        gpu=GPU_PER_JOB,
        mem_mb=DECODE_MEM_MB,
        runtime=video_runtime(config, 1, config["video"]["num_frames"]),
    params:
        rollouts=["survey"],
        vae=lambda wildcards: vae_path(config, wildcards.checkpoint),
        settings={"device": config["device"], "dtype": config["dtype"]},
        sink_frames=0,
    script:
        "../scripts/videos.py"


rule video_summary:
    input:
        metrics=[
            f"results/videos/{checkpoint}/{prompt}/metrics.csv"
            for checkpoint, prompt in VIDEO_RUNS
        ]
        + [
            f"results/videos/{checkpoint}/{prompt}/survey.metrics.csv"
            for checkpoint, prompt in SURVEY_VIDEO_RUNS
        ],
        # what the frame strips show: the closed loop's rollouts, and the survey's where decoded
        videos=[
            f"results/videos/{checkpoint}/{prompt}/{rollout}.mp4"
            for checkpoint, prompt in VIDEO_RUNS
            for rollout in CLOSED_LOOP_ROLLOUTS
        ]
        + [
            f"results/videos/{checkpoint}/{prompt}/survey.mp4"
            for checkpoint, prompt in VIDEO_RUNS
            if (checkpoint, prompt) in SURVEY_VIDEO_RUNS
        ],
        frames=[
            f"results/closed_loop/{checkpoint}/{prompt}/{rollout}.csv"
            for checkpoint, prompt in VIDEO_RUNS
            for rollout in CLOSED_LOOP_ROLLOUTS
        ],
        blocks="results/closed_loop/blocks.csv" if VIDEO_RUNS else [],
        grids=[
            f"results/videos/{checkpoint}/{prompt}/grid.mp4"
            for checkpoint, prompt in VIDEO_RUNS
        ],
    output:
        metrics=report(
            "results/videos/metrics.csv",
            caption="../report/video_metrics.rst",
            category="Videos",
            labels={"table": "pixel diagnostics (csv)"},
        ),
        drift=report(
            "results/videos/drift.csv",
            caption="../report/video_drift.rst",
            category="Videos",
            labels={"table": "quality drift (csv)"},
        ),
        # the grid videos, playable inside the report (which shows an mp4 only as a download)
        pages=[
            report(
                f"results/videos/{checkpoint}/{prompt}/grid.html",
                caption="../report/video_grid.rst",
                category="Videos",
                subcategory=f"{checkpoint} / {prompt}",
                labels={"video": "every rollout side by side"},
            )
            for checkpoint, prompt in VIDEO_RUNS
        ],
        figures=[
            report(
                figure.path.format(checkpoint=checkpoint, prompt=prompt),
                caption=f"../report/{figure.kind.caption}",
                category="Figures",
                subcategory=f"{checkpoint} / {prompt}",
                labels=figure.labels,
            )
            for checkpoint, prompt in VIDEO_RUNS
            for figure in VIDEO_FIGURES
        ],
    log:
        "results/logs/videos/summary.log",
    # With the other summaries, once every extraction job is done.
    priority: 1
    conda:
        "../envs/analysis.yaml"
    params:
        train_frames=config["video"]["num_frames"],
        figures=canonical(config["figures"]),
    script:
        "../scripts/video_summary.py"
