"""Snakemake adapter: rule encode_prompt (encode the text, each segment's of a prompt of
segments, or import precomputed embeddings)."""

from sinkscope.logs import job_log
from sinkscope.segments import Segment
from sinkscope.wan.text import encode_prompts, import_prompt_embedding, save_prompt_segments
from sinkscope.workflow.gpus import job_device

with job_log(snakemake.log[0]):
    text = snakemake.params.text
    encoder = snakemake.params.encoder
    segments = [Segment(**segment) for segment in snakemake.params.segments or [{"text": text}]]
    if encoder is None:
        import_prompt_embedding(snakemake.input.embeddings, snakemake.output[0], prompt=text)
    else:
        with job_device(snakemake.params.device) as claim:
            encoded = encode_prompts(
                [segment.text for segment in segments],
                encoder["path"],
                tokenizer_dir=encoder["tokenizer"],
                text_len=encoder["text_len"],
                device=claim.device,
                dtype=snakemake.params.dtype,
                # From the config, not params: it decides whether the job fails, not its bytes.
                on_truncate=snakemake.config["text_encoder"]["truncate"],
            )
        save_prompt_segments(snakemake.output[0], encoded, segments)
