#!/usr/bin/env bash
# Write a newer ComfyUI into the machine's ComfyUI cache, outside the repository, where the tests look for it
# (tests/comfyui_copies.py: ${PIPETRAIN_COMFYUI_CACHE:-~/.cache/pipetrain/comfyui}/<version>/, and the packages it
# needs beyond .venv in <version>-site/). Never commit a ComfyUI.
#
#   scripts/comfyui_cache.sh 0.33.0 GIT_DIR [REF]     # GIT_DIR: a bare clone or mirror of ComfyUI's repository
#   scripts/comfyui_cache.sh 0.8.0  GIT_DIR 3cd7b32f
#
# A mirror that lacks its largest blobs (tokenizer files) is filled from the pinned ComfyUI where the blob hashes
# match, by the exporter named in EXPORT_COMFYUI (default: ../shared/tools/export_comfyui.py beside the repository).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?version, e.g. 0.33.0}
git_dir=${2:?git dir of a ComfyUI clone or mirror}
ref=${3:-HEAD}
cache=${PIPETRAIN_COMFYUI_CACHE:-$HOME/.cache/pipetrain/comfyui}
export_tool=${EXPORT_COMFYUI:-../shared/tools/export_comfyui.py}
VPY=.venv/bin/python

# the packages each version's requirements.txt adds to what .venv has (their frontend, templates, comfy-kitchen)
case "$version" in
  0.33.0) extras=(comfy-kitchen==0.2.31 comfy-aimdo==0.4.13 comfyui-frontend-package==1.49.6
                  comfyui-workflow-templates==0.11.44 comfyui-embedded-docs==0.5.10 blake3 simpleeval) ;;
  0.8.0)  extras=(comfy-kitchen==0.2.31 comfyui-frontend-package==1.35.9 comfyui-workflow-templates==0.7.67
                  comfyui-embedded-docs==0.3.1) ;;
  *) echo "unknown version $version: add its extra packages here" >&2; exit 2 ;;
esac

mkdir -p "$cache"
stage=$(mktemp -d "$cache/.stage-$version.XXXX")
python3 "$export_tool" "$git_dir" "$ref" "$stage/tree" --fill .comfyui/ComfyUI
grep -q "__version__ = \"$version\"" "$stage/tree/comfyui_version.py" \
  || { echo "$git_dir at $ref is not ComfyUI $version" >&2; rm -rf "$stage"; exit 1; }
"$VPY" -m pip install -q --disable-pip-version-check --no-deps --target "$stage/site" "${extras[@]}"
rm -rf "${cache:?}/$version" "${cache:?}/$version-site"
mv "$stage/tree" "$cache/$version"
mv "$stage/site" "$cache/$version-site"
rmdir "$stage"
echo "ComfyUI $version at $cache/$version (extra packages in $cache/$version-site)"
