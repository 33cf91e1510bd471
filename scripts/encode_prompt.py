"""Snakemake adapter: rule encode_prompt."""

from sinkscope.extract import resolve_device
from sinkscope.logs import job_log
from sinkscope.wan.text import encode_prompt, save_prompt_embedding

with job_log(snakemake.log[0]):
    encoder = snakemake.params.encoder
    embeds, length = encode_prompt(
        snakemake.params.text,
        encoder["path"],
        tokenizer_dir=encoder["tokenizer"],
        text_len=encoder["text_len"],
        device=resolve_device(snakemake.params.device),
    )
    save_prompt_embedding(snakemake.output[0], embeds, prompt=snakemake.params.text, length=length)
