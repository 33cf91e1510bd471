"""Wan's prompt cleaning, torch-free: the config checks apply it while Snakemake parses (a prompt
that cleans to nothing is a config error), the text encoder before tokenizing."""

from __future__ import annotations

import html
import re

import ftfy


def clean_prompt(text: str) -> str:
    """Wan's `basic_clean` then `whitespace_clean`: ftfy's `fix_text` (curly quotes straightened,
    fullwidth characters narrowed, mojibake decoded), HTML unescaped twice, spaces collapsed."""
    text = html.unescape(html.unescape(ftfy.fix_text(text)))
    return re.sub(r"\s+", " ", text).strip()
