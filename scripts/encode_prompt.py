"""Snakemake adapter: rule encode_prompt (encode the text, each segment's of a prompt of
segments; copy it from the prompt cache; or import precomputed embeddings)."""

from sinkscope.extraction.prompts import encode_prompt_job
from sinkscope.logs import job_log
from sinkscope.wan.text import import_prompt_embedding
from sinkscope.workflow.gpus import job_device

with job_log(snakemake.log[0]):
    params = snakemake.params
    if params.encoder is None:
        import_prompt_embedding(snakemake.input.embeddings, snakemake.output[0], prompt=params.text)
    else:
        encode_prompt_job(
            snakemake.output[0],
            params.text,
            params.segments,
            params.encoder,
            device=params.device,
            dtype=params.dtype,
            # From the config, not params: it decides whether the job fails, not its bytes.
            on_truncate=snakemake.config["text_encoder"]["truncate"],
            claim=job_device,
        )
