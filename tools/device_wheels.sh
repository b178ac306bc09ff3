#!/usr/bin/env bash
# The wheels the GPU machine's image lacks beyond the HTTP stack: llguidance (structured output;
# without it tests/gpu/test_gpu_constrained.py skips its kill test). Run here, in the checkout's
# root, after the shared wheel copy; carry .whl to the GPU machine (tools/h200_run.sh installs it).
# The version is the one pyproject.toml's lower bound names (an older llguidance, 1.6.1, the newest
# with manylinux_2_28 wheels, takes a different LLTokenizer and fails every structured request).
set -eu
top=$(git rev-parse --show-toplevel)
mkdir -p "$top/.whl"
rm -f "$top"/.whl/llguidance-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$top/.whl" "llguidance==1.9.1"
grep -qx '/.whl/' "$top/.git/info/exclude" 2>/dev/null || echo '/.whl/' >> "$top/.git/info/exclude"
ls "$top/.whl" | grep -i llguidance
