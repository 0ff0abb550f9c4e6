# SPDX-License-Identifier: GPL-3.0-or-later
"""The parity verdict's memo key names the files it depends on by their place in ComfyUI's folder and PipeTrain's,
not by where those folders are: the same code at another path (a CI checkout, a moved install) keeps its verdicts,
and a changed byte or a moved file takes the check again."""
from pipetrain.backend.parity import check


def _comfyui(root, ops: str = "ops\n"):
    flux = root / "comfy" / "ldm" / "flux"
    flux.mkdir(parents=True, exist_ok=True)
    (flux / "model.py").write_text("class Flux: pass\n")
    (root / "comfy" / "ops.py").write_text(ops)
    return root


def test_the_same_comfyui_code_at_another_path_keeps_its_key_and_a_change_does_not(tmp_path):
    here, there = _comfyui(tmp_path / "ComfyUI"), _comfyui(tmp_path / "elsewhere" / "ComfyUI")
    key = check._memo_key("flux", "0.3.75", here)
    assert check._memo_key("flux", "0.3.75", there) == key
    (tmp_path / "link").symlink_to(there)
    assert check._memo_key("flux", "0.3.75", tmp_path / "link") == key
    _comfyui(there, ops="ops, changed\n")
    assert check._memo_key("flux", "0.3.75", there) != key
    _comfyui(there)
    (there / "comfy" / "ldm" / "flux" / "model.py").rename(there / "comfy" / "ldm" / "flux" / "layers.py")
    assert check._memo_key("flux", "0.3.75", there) != key
    assert check._memo_key("sdxl", "0.3.75", here) != key and check._memo_key("flux", "0.8.0", here) != key
