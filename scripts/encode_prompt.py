"""Snakemake adapter: rule encode_prompt (encode the text, or import precomputed embeddings)."""

from sinkscope.logs import job_log
from sinkscope.wan.text import encode_prompt, import_prompt_embedding, save_prompt_embedding
from sinkscope.workflow.gpus import job_device

with job_log(snakemake.log[0]):
    text = snakemake.params.text
    encoder = snakemake.params.encoder
    if encoder is None:
        import_prompt_embedding(snakemake.input.embeddings, snakemake.output[0], prompt=text)
    else:
        with job_device(snakemake.params.device) as claim:
            encoded = encode_prompt(
                text,
                encoder["path"],
                tokenizer_dir=encoder["tokenizer"],
                text_len=encoder["text_len"],
                device=claim.device,
                dtype=snakemake.params.dtype,
                # From the config, not params: it decides whether the job fails, not its bytes.
                on_truncate=snakemake.config["text_encoder"]["truncate"],
            )
        save_prompt_embedding(
            snakemake.output[0],
            encoded.embeds,
            prompt=text,
            length=encoded.length,
            prompt_tokens=encoded.prompt_tokens,
        )
