"""The Wan2.1 T2V DiT and its text encoder, as the checkpoints researchers have define them.

Torch: `model.py` (the DiT with its block-causal KV cache), `rope.py`, `checkpoint.py` (loading
and saving weights), `lora.py` (LoRA adapters, run unmerged), `text.py` (UMT5 prompt encoding,
the tokenizer's tokenizer.json run through `tokenizers`), `umt5.py` (the UMT5 encoder: our own,
in transformers' key layout, proven bit-equal to its `UMT5EncoderModel` in the tests, as
importing transformers' UMT5 cost ~5 s per job), `precision.py` (the `dtype` setting), `vae.py`
(Wan2.1's VAE: both file layouts, streaming decode to uint8 frames, encode) and `vae_net.py`
(its network: our own, in Wan's original layout, proven bit-equal to diffusers'
`AutoencoderKLWan` in the tests, the only place diffusers is imported, as importing it cost
5-6.5 s per job). Torch-free, so Snakemake can read them while
parsing: `config.py` (`WanConfig`), `layout.py` (checkpoint formats and their files), `spec.py`
(`CheckpointSpec`), `lora_keys.py` (a LoRA file's keys and shapes, what is refused) and `demo.py`
(the demo model's size; torch only to make one).
Imports nothing of sinkscope but the shared `storage`, `cache_choices` (the kinds of key a
cache labels, `KEY_KIND`) and `segments` (a prompt's segments, in its embeddings file).
"""
