"""Edit datasets: control images pair with training files by file stem, unpaired files are listed before
anything is encoded, and the cache key of a sample covers its control image's bytes."""
import pytest
from test_data_scan import dataset, write_image

from pipetrain.backend.cache import CacheStore
from pipetrain.backend.cache.manifest import build_entries
from pipetrain.backend.config import DirectoryConfig, load_dataset_config
from pipetrain.backend.data import build_examples, check_control_paths, scan_dataset
from pipetrain.backend.errors import ConfigError, DatasetError


def _edit_folder(root, names=("a", "b"), controls=("a", "b")):
    (root / "targets").mkdir(parents=True)
    (root / "controls").mkdir()
    for n in names:
        write_image(root / "targets" / f"{n}.png", (32, 32))
        (root / "targets" / f"{n}.txt").write_text(f"make {n} red")
    for n in controls:
        write_image(root / "controls" / f"{n}.jpg", (32, 32))
    return DirectoryConfig(str(root / "targets"), control_path=str(root / "controls"))


def test_each_file_gets_the_control_image_with_its_stem(tmp_path):
    result = scan_dataset(dataset(_edit_folder(tmp_path)))
    assert [(i.path.name, i.control.name) for i in result.items] == [("a.png", "a.jpg"), ("b.png", "b.jpg")]


def test_unpaired_files_on_both_sides_are_listed(tmp_path):
    directory = _edit_folder(tmp_path, names=("a", "b", "c"), controls=("a", "b", "z"))
    with pytest.raises(DatasetError) as e:
        scan_dataset(dataset(directory))
    message = str(e.value)
    assert "2 unpaired file(s)" in message
    assert "c.png: no control image named c.*" in message and "z.jpg: no training file named z.*" in message


def test_missing_control_directory_names_the_key(tmp_path):
    directory = _edit_folder(tmp_path)
    directory.control_path = str(tmp_path / "nope")
    with pytest.raises(DatasetError, match="directory.control_path"):
        scan_dataset(dataset(directory))


def test_control_path_in_a_dataset_toml_is_relative_to_it_and_top_level_is_refused(tmp_path):
    _edit_folder(tmp_path)
    (tmp_path / "dataset.toml").write_text('resolutions = [64]\n[[directory]]\npath = "targets"\n'
                                           'control_path = "controls"\n')
    cfg = load_dataset_config(tmp_path / "dataset.toml")
    assert scan_dataset(cfg).items[0].control == tmp_path / "controls" / "a.jpg"
    (tmp_path / "bad.toml").write_text('control_path = "controls"\n[[directory]]\npath = "targets"\n')
    with pytest.raises(ConfigError, match="control_path"):
        load_dataset_config(tmp_path / "bad.toml")


class _Adapter:
    arch, latent_format = "edit", "Flux"
    conditioning_fields = ("reference",)

    def __init__(self, needs_control=True, caption_sees_control=False):
        self.needs_control = needs_control
        self.caption_sees_control = caption_sees_control

    def text_options(self) -> dict:
        return {}


def test_edit_models_need_a_control_path_and_other_models_refuse_one(tmp_path):
    directory = _edit_folder(tmp_path)
    check_control_paths(dataset(directory), _Adapter(), "dataset")
    with pytest.raises(DatasetError, match="not an edit model"):
        check_control_paths(dataset(directory), _Adapter(needs_control=False), "dataset")
    directory.control_path = None
    with pytest.raises(DatasetError, match="has no control_path"):
        check_control_paths(dataset(directory), _Adapter(), "dataset")


def test_cache_key_covers_the_control_image(tmp_path, micro_flux_files):
    cfg = dataset(_edit_folder(tmp_path), resolutions=[64])
    files = {"vae": [micro_flux_files.vae], "text_encoders": micro_flux_files.text_encoders}

    def keys(adapter=_Adapter()):
        samples = build_examples(cfg, scan_dataset(cfg).items)
        return {e.path.rsplit("/", 1)[-1]: (e.latent, e.control, e.text) for e in build_entries(samples, adapter, files)}

    before, seeing_before = keys(), keys(_Adapter(caption_sees_control=True))
    assert before["a.png"][1].endswith("controls/a.jpg")
    write_image(tmp_path / "controls" / "a.jpg", (33, 32))       # a new control image, same name
    after, seeing_after = keys(), keys(_Adapter(caption_sees_control=True))
    assert after["a.png"][0] != before["a.png"][0] and after["b.png"] == before["b.png"]
    # the caption's embedding depends on the control image only where the text encoder reads it
    assert after["a.png"][2] == before["a.png"][2]
    assert seeing_after["a.png"][2] != seeing_before["a.png"][2] and seeing_after["b.png"] == seeing_before["b.png"]
    assert seeing_before["a.png"][2] != before["a.png"][2]


def test_caption_dropout_keeps_the_control_image_where_the_text_encoder_reads_it(tmp_path, micro_flux_files):
    from pipetrain.backend.train.caching import empty_captions

    cfg = dataset(_edit_folder(tmp_path), resolutions=[64])
    write_image(tmp_path / "controls" / "a.jpg", (33, 32))       # the two control images differ
    files = {"vae": [micro_flux_files.vae], "text_encoders": micro_flux_files.text_encoders}
    samples = build_examples(cfg, scan_dataset(cfg).items)
    for sees in (False, True):
        adapter = _Adapter(caption_sees_control=sees)
        adapter.model_files = lambda: files
        entries = build_entries(samples, adapter, files)
        swap, work = empty_captions(adapter, entries, CacheStore(tmp_path / "cache"))
        assert set(swap) == {e.text for e in entries} and set(work) == set(swap.values())
        assert all(w.caption == "" for w in work.values())
        if sees:    # one empty caption per control image, read with that image
            assert {swap[e.text]: work[swap[e.text]].control for e in entries} == {
                swap[e.text]: e.control for e in entries} and len(work) == len({e.control for e in entries}) == 2
        else:       # one empty caption for every sample
            assert len(work) == 1


def test_several_control_folders_pair_in_order_and_each_image_is_in_the_keys(tmp_path, micro_flux_files):
    """control_path as a list (Qwen-Image-Edit-2509, Flux 2 edit): one image from each folder, in the list's
    order; a missing partner in any folder is listed; each image's bytes are in the latent and caption keys."""
    directory = _edit_folder(tmp_path)
    (tmp_path / "second").mkdir()
    for n in ("a", "b"):
        write_image(tmp_path / "second" / f"{n}.png", (32, 32))
    directory.control_path = [str(tmp_path / "controls"), str(tmp_path / "second")]
    cfg = dataset(directory, resolutions=[64])
    items = scan_dataset(cfg).items
    assert [tuple(p.name for p in i.controls) for i in items] == [("a.jpg", "a.png"), ("b.jpg", "b.png")]
    assert [i.more_controls[0].parent.name for i in items] == ["second", "second"]

    files = {"vae": [micro_flux_files.vae], "text_encoders": micro_flux_files.text_encoders}
    adapter = _Adapter(caption_sees_control=True)

    def keys():
        entries = build_entries(build_examples(cfg, scan_dataset(cfg).items), adapter, files)
        return {e.path.rsplit("/", 1)[-1]: (e.latent, e.text, e.more_controls) for e in entries}

    before = keys()
    assert before["a.png"][2] == (str(tmp_path / "second" / "a.png"),)
    write_image(tmp_path / "second" / "a.png", (33, 32))         # only the second control image of a changes
    after = keys()
    assert after["a.png"][0] != before["a.png"][0]                # the latent key (the references)
    assert after["a.png"][1] != before["a.png"][1] and after["b.png"] == before["b.png"]

    (tmp_path / "second" / "b.png").unlink()
    with pytest.raises(DatasetError, match="b.png: no control image named b.* in .*second"):
        scan_dataset(cfg)


def test_a_list_of_control_folders_loads_from_toml_and_an_empty_one_is_refused(tmp_path):
    _edit_folder(tmp_path)
    (tmp_path / "dataset.toml").write_text('resolutions = [64]\n[[directory]]\npath = "targets"\n'
                                           'control_path = ["controls", "controls"]\n')
    cfg = load_dataset_config(tmp_path / "dataset.toml")
    assert cfg.control_paths(cfg.directory[0]) == [tmp_path / "controls"] * 2
    (tmp_path / "empty.toml").write_text('[[directory]]\npath = "targets"\ncontrol_path = []\n')
    with pytest.raises(ConfigError, match="directory.control_path"):
        load_dataset_config(tmp_path / "empty.toml")
