#!/bin/sh
# Installs sinkscope into the conda env made from export.yaml.
# Snakemake runs this once, right after creating the env, with the env activated and the Snakemake
# process's environment, in which rules/common.smk sets SINKSCOPE_SOURCE to the workflow's checkout.
# Snakemake copies this file alone next to the env, so it finds the checkout through that variable,
# not through its own path. --no-deps: export.yaml pins everything the code needs; -e: the env
# follows the checkout (edits to sinkscope need no new env).
set -eu
src="${SINKSCOPE_SOURCE:-}"
if [ -z "$src" ] || ! grep -qx 'name = "sinkscope"' "$src/pyproject.toml" 2>/dev/null; then
    echo "export.post-deploy.sh: SINKSCOPE_SOURCE must be a sinkscope checkout" \
        "(a pyproject.toml with name = \"sinkscope\"), got '$src'" >&2
    exit 1
fi
pip install --no-deps --no-build-isolation -e "$src"
