"""Wan's prompt cleaning, torch-free: the config checks apply it while Snakemake parses (a prompt
that cleans to nothing is a config error), the text encoder before tokenizing."""

from __future__ import annotations

import html
import re


def clean_prompt(text: str) -> str:
    """ftfy if installed (as in Wan's tokenizer wrapper), HTML unescaped twice, spaces collapsed."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text))
    return re.sub(r"\s+", " ", text).strip()
