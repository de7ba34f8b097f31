"""Presets: YAML in, validated Settings out, and back again without losing a value."""

from __future__ import annotations

import errno
import os
import resource
import signal
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tuitrain import presets
from tuitrain.preset_folders import SHIPPED_DIR, find_preset, list_presets, preset_listing
from tuitrain.presets import PresetError, dump_preset, load_preset, merge, save_preset
from tuitrain.settings import (
    COLLECTIVE_TIMEOUT_MAX,
    InvalidSettings,
    Settings,
    validate_settings,
)

SHIPPED = {"laptop-6gb", "laptop-16gb", "desktop-24gb", "v100-32gb", "cpu-only"}
REPO = Path(__file__).resolve().parents[2]


def write(folder: Path, text: str, name: str = "x.yaml") -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


# --- shipped presets ---------------------------------------------------------------------


def test_shipped_presets_live_in_the_repository_presets_folder():
    assert SHIPPED_DIR == REPO / "presets"


def test_the_hardware_stories_are_shipped_each_with_a_description():
    listed = dict(list_presets())
    assert set(listed) == SHIPPED
    for name, description in listed.items():
        assert len(description) > 20, name
        assert description.endswith("."), f"{name}: its first paragraph, whole: {description}"
    assert listed["laptop-16gb"].endswith("with the optimizer state that does not fit in RAM "
                                          "on the SSD.")


def test_the_listing_wraps_a_long_description_under_itself_within_100_columns():
    lines = preset_listing()
    assert all(len(line) <= 100 for line in lines), [len(line) for line in lines]
    start = next(i for i, line in enumerate(lines) if line.startswith("laptop-16gb "))
    words = " ".join(lines[start:start + 2]).split()
    assert words == ["laptop-16gb", *dict(list_presets())["laptop-16gb"].split()]
    indent = lines[start].index("Gaming")
    assert lines[start + 1][:indent].isspace(), "indented under itself"
    assert lines[start + 1][indent] != " "


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_shipped_preset_validates_and_names_its_model(name):
    path = find_preset(name)
    loaded = load_preset(path)
    assert "model" in loaded.model_fields_set
    assert loaded.model.startswith("opt-")
    # Its numbers are explained: there are comments besides the one-line description.
    comments = [line for line in path.read_text().splitlines() if line.lstrip().startswith("#")]
    assert len(comments) >= 8, name


def test_shipped_presets_fit_their_hardware_stories():
    laptop = load_preset(find_preset("laptop-6gb"))
    assert laptop.engine.precision == "bf16"
    assert laptop.engine.policy == "auto"
    assert laptop.device_budget_for(simulated=False) < 6 * 1024**3  # room for the desktop
    v100 = load_preset(find_preset("v100-32gb"))
    assert v100.engine.precision == "fp16"  # Volta has no bf16
    assert load_preset(find_preset("cpu-only")).engine.precision == "fp32"


def test_the_16_gib_laptop_sends_what_ram_cannot_hold_to_disk_and_fits():
    from engine.planning.planner import plan

    laptop = load_preset(find_preset("laptop-16gb"))
    assert laptop.engine.host_budget.nbytes == 9 * 1024**3
    t = laptop.training
    # On the laptop's GPU (not simulated): 16 GiB less ~3 GiB for the system and desktop.
    planned = plan(laptop.model, device_mem=laptop.engine.device_budget.nbytes,
                   host_mem=13 * 1024**3, precision=laptop.engine.precision,
                   batch_size=t.batch_size, seq_len=t.seq_len,
                   checkpointing=t.activation_checkpointing, simulated=False,
                   margin_ratio=laptop.engine.margin_ratio,
                   host_budget=laptop.engine.host_budget.nbytes)
    auto = planned.auto
    assert auto.fits, auto.reason
    assert 0 < auto.disk_bytes < 12 * 1024**3  # optimizer state only: payloads stay in RAM
    assert auto.host_peak <= 13 * 1024**3


# --- finding ----------------------------------------------------------------------------


def test_find_preset_takes_a_name_a_name_with_suffix_or_a_path(tmp_path):
    assert find_preset("cpu-only") == SHIPPED_DIR / "cpu-only.yaml"
    assert find_preset("cpu-only.yaml") == SHIPPED_DIR / "cpu-only.yaml"
    own = write(tmp_path, "version: 1\n", "mine.yaml")
    assert find_preset(own) == own
    assert find_preset(str(own)) == own


def test_a_file_in_the_working_folder_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "version: 1\nmodel: tiny\n", "cpu-only.yaml")
    assert find_preset("cpu-only.yaml").resolve() == (tmp_path / "cpu-only.yaml").resolve()


def test_an_unknown_preset_lists_the_shipped_ones(tmp_path):
    with pytest.raises(PresetError) as caught:
        find_preset("gaming-rig")
    message = str(caught.value)
    assert "gaming-rig" in message
    assert all(name in message for name in SHIPPED)
    with pytest.raises(PresetError, match="no such preset"):
        find_preset(str(tmp_path / "missing.yaml"))


# --- loading: every mistake is one line naming the file and the key ----------------------


def assert_one_line(error: PresetError, path: Path, *needles: str) -> str:
    message = str(error)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    for needle in needles:
        assert needle in message
    return message


def test_margin_out_of_range_names_file_key_range_and_value(tmp_path):
    path = write(tmp_path, "version: 1\nengine:\n  margin_ratio: 1.5\n")
    with pytest.raises(PresetError) as caught:
        load_preset(path)
    assert str(caught.value) == f"{path}: engine.margin_ratio: must be within 0..1 (got 1.5)"


def test_unknown_key_is_named_with_the_keys_that_exist_there(tmp_path):
    path = write(tmp_path, "version: 1\nengine:\n  polcy: cpu\n")
    with pytest.raises(PresetError) as caught:
        load_preset(path)
    assert_one_line(caught.value, path, "engine.polcy", "unknown key", "policy", "margin_ratio")


def test_unknown_top_level_section(tmp_path):
    path = write(tmp_path, "version: 1\noptimiser:\n  lr: 0.1\n")
    with pytest.raises(PresetError) as caught:
        load_preset(path)
    assert_one_line(caught.value, path, "optimiser: unknown key", "training")


@pytest.mark.parametrize(
    ("body", "needles"),
    [
        ("training:\n  steps: many\n", ("training.steps", "whole number", "'many'")),
        ("training:\n  batch_size: 2.5\n", ("training.batch_size", "whole number")),
        ("training:\n  activation_checkpointing: maybe\n", ("activation_checkpointing",)),
        ("engine:\n  policy: gpu\n", ("engine.policy", "'cuda', 'cpu' or 'auto'", "'gpu'")),
        ("engine:\n  precision: fp8\n", ("engine.precision", "fp8")),
        ("engine:\n  device_budget: lots\n", ("engine.device_budget", "not a size", "lots")),
        ("engine:\n  device_budget: 0\n", ("engine.device_budget", "more than 0 bytes")),
        ("engine:\n  host_budget: 0MiB\n", ("engine.host_budget", "more than 0 bytes")),
        ("engine: [cuda, cpu]\n", ("engine: must be a mapping", "a list")),
        ("model: 125\n", ("model: must be text", "125")),
        ("training:\n  steps: 0\n", ("training.steps", "greater than 0")),
        ("training:\n  lr: -0.1\n", ("training.lr", "greater than 0")),
    ],
)
def test_wrong_types_and_values_name_the_key(tmp_path, body, needles):
    path = write(tmp_path, "version: 1\n" + body)
    with pytest.raises(PresetError) as caught:
        load_preset(path)
    assert_one_line(caught.value, path, *needles)


def test_several_mistakes_report_the_first_and_count_the_rest(tmp_path):
    path = write(tmp_path, "version: 1\nengine:\n  margin_ratio: 2\ntraining:\n  steps: 0\n")
    with pytest.raises(PresetError) as caught:
        load_preset(path)
    assert_one_line(caught.value, path, "engine.margin_ratio", "(and 1 more)")


def test_malformed_yaml_says_where(tmp_path):
    path = write(tmp_path, "version: 1\nengine:\n  policy: cpu\n   margin_ratio: 0.5\n")
    with pytest.raises(PresetError) as caught:
        load_preset(path)
    assert_one_line(caught.value, path, "line 4", "malformed YAML")


def test_a_key_given_twice_is_an_error_not_a_silent_choice(tmp_path):
    path = write(tmp_path, "version: 1\nengine:\n  policy: cpu\n  policy: cuda\n")
    with pytest.raises(PresetError) as caught:
        load_preset(path)
    assert_one_line(caught.value, path, "duplicate key 'policy'", "line 4")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty preset"),
        ("# only a comment\n", "empty preset"),
        ("- policy: cpu\n", "expected a mapping"),
        ("just words\n", "expected a mapping"),
        ("model: tiny\n", "version: missing"),
        ("version: 2\nmodel: tiny\n", "version: unsupported preset version 2"),
        ("version: one\n", "version: unsupported preset version 'one'"),
    ],
)
def test_not_a_preset(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(PresetError) as caught:
        load_preset(path)
    assert_one_line(caught.value, path, needle)


def test_a_file_that_is_not_a_regular_one_is_named_so_not_missing(tmp_path):
    pipe = tmp_path / "preset.yaml"
    os.mkfifo(pipe)
    for path in (Path(os.devnull), pipe):
        with pytest.raises(PresetError) as caught:
            find_preset(str(path))
        assert_one_line(caught.value, path, "is not a regular file")
        assert "no such preset" not in str(caught.value)


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(PresetError) as caught:
        load_preset(tmp_path / "nope.yaml")
    assert_one_line(caught.value, tmp_path / "nope.yaml", "no such preset file")
    with pytest.raises(PresetError) as caught:
        load_preset(tmp_path)
    assert_one_line(caught.value, tmp_path, "is a folder")


def test_not_utf8(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_bytes(b"version: 1\nmodel: \xff\xfe\n")
    with pytest.raises(PresetError) as caught:
        load_preset(path)
    assert_one_line(caught.value, path, "cannot read")


def test_unset_keys_keep_the_built_in_defaults(tmp_path):
    loaded = load_preset(write(tmp_path, "version: 1\nengine:\n  policy: cpu\n"))
    defaults = Settings()
    assert loaded.engine.policy == "cpu"
    assert loaded.training == defaults.training
    assert loaded.engine.margin_ratio == defaults.engine.margin_ratio
    assert "model" not in loaded.model_fields_set


def test_yaml_tags_that_build_objects_are_refused(tmp_path):
    path = write(tmp_path, "version: 1\nmodel: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(PresetError):
        load_preset(path)


# --- merge ------------------------------------------------------------------------------


def test_merge_takes_dotted_keys_and_nested_mappings_and_leaves_the_input_alone():
    base = Settings()
    merged = merge(
        base,
        {"engine.margin_ratio": 0.5, "training": {"steps": 7}, "model": "tiny"},
    )
    assert merged.engine.margin_ratio == 0.5
    assert merged.training.steps == 7
    assert merged.training.batch_size == base.training.batch_size  # siblings untouched
    assert merged.model == "tiny"
    assert base == Settings()


def test_merge_rejects_bad_values_and_unknown_keys_by_dotted_key():
    with pytest.raises(InvalidSettings) as caught:
        merge(Settings(), {"engine.margin_ratio": 1.5})
    assert caught.value.key == "engine.margin_ratio"
    assert caught.value.problem == "must be within 0..1 (got 1.5)"
    with pytest.raises(InvalidSettings) as caught:
        merge(Settings(), {"engine.margn_ratio": 0.5})
    assert caught.value.key == "engine.margn_ratio"


# --- dump and round trip -----------------------------------------------------------------


def test_dump_starts_with_the_reproducing_command_and_the_measurements():
    text = dump_preset(
        Settings(model="tiny"),
        command="tuitrain run --preset p.yaml --headless",
        measured={
            "device_peak": 5 * 1024**3,
            "step_seconds": 1.25,
            "tokens_per_second": 3300.0,
            "step": 200,
        },
    )
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert text.startswith("# tuitrain preset, saved ")
    assert "# reproduce: tuitrain run --preset p.yaml --headless" in header
    # In the trials' words and units: a preset, the app and a headless summary read alike.
    assert "# measured at step 200: 1.25 s/step, 3,300 tok/s, device peak 5.0 GiB" in header
    assert yaml.safe_load(text)["model"] == "tiny"


def test_dump_keeps_a_multi_line_command_inside_the_comment():
    text = dump_preset(Settings(), command="tuitrain run\nmodel: evil", measured={"note": "a\nb"})
    assert yaml.safe_load(text)["model"] == Settings().model


texts = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=30)
sizes = st.one_of(
    st.none(),
    st.integers(1, 2**44).map(str),  # a budget of 0 bytes is refused (a test above)
    st.sampled_from(["6GiB", "5.5GiB", "512MiB", "1.5GB", "1000", "1"]),
)
positive = st.floats(min_value=1e-12, max_value=1e3, allow_nan=False)
settings_data = st.fixed_dictionaries(
    {
        "version": st.just(1),
        "model": texts,
        "engine": st.fixed_dictionaries(
            {
                "policy": st.sampled_from(["cuda", "cpu", "auto"]),
                "margin_ratio": st.floats(0.0, 1.0),
                "device_budget": sizes,
                "precision": st.sampled_from(["fp32", "bf16", "fp16"]),
                "chunk_size": st.none() | st.integers(1, 2**40),
                "collective_timeout": st.floats(1e-3, COLLECTIVE_TIMEOUT_MAX),
            }
        ),
        "training": st.fixed_dictionaries(
            {
                "batch_size": st.integers(1, 4096),
                "seq_len": st.integers(2, 65536),
                "steps": st.integers(1, 10**12),
                "lr": positive,
                "weight_decay": st.floats(0.0, 10.0),
                "max_grad_norm": st.none() | positive,
                "seed": st.integers(-(2**63), 2**63 - 1),
                "grad_accum": st.integers(1, 1024),
                "activation_checkpointing": st.booleans(),
                "lr_schedule": st.sampled_from(["constant", "linear", "cosine"]),
                "warmup_steps": st.integers(0, 10**6),
                "eval_every": st.none() | st.integers(1, 10**6),
                "eval_batches": st.integers(1, 1024),
            }
        ),
        "data": st.one_of(
            st.fixed_dictionaries({"path": st.none() | texts, "text_field": texts}),
            st.fixed_dictionaries({"path": st.none() | texts, "eval_path": texts}),
            st.fixed_dictionaries(
                {"path": st.none() | texts, "eval_fraction": st.floats(1e-6, 0.5)}
            ),
        ),
        "logging": st.fixed_dictionaries(
            {"metrics": st.none() | texts, "every": st.integers(1, 10**6)}
        ),
        "checkpoint": st.fixed_dictionaries(
            {
                "dir": st.none() | texts,
                "every": st.none() | st.integers(1, 10**6),
                "resume": st.none() | texts,
            }
        ),
    }
).map(
    # Evaluating needs held-out text: without any, the run has no eval_every, and its
    # eval_batches is the default, as a saved preset writes it.
    lambda d: d if "eval_path" in d["data"] or "eval_fraction" in d["data"]
    else {**d, "training": {**d["training"], "eval_every": None, "eval_batches": 8}}
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=settings_data, command=st.none() | texts)
def test_save_then_load_gives_back_every_value(tmp_path_factory, data, command):
    """Every value but the checkpoint a run resumed from, which a saved preset leaves out
    (test_a_preset_saved_from_a_resumed_run_starts_afresh)."""
    original = validate_settings(data)
    path = tmp_path_factory.mktemp("roundtrip") / "p.yaml"
    save_preset(original, path, command=command, measured={"step": 3})
    loaded = load_preset(path)
    fresh = original.model_copy(
        update={"checkpoint": original.checkpoint.model_copy(update={"resume": None})})
    assert loaded == fresh
    assert loaded.model_dump() == fresh.model_dump()


def test_a_preset_saved_from_a_resumed_run_starts_afresh(tmp_path):
    """Where a run started is not how it trains: a preset saved from a run that resumed
    (or a tune of one) runs from the start wherever it is used, and keeps the rest,
    the checkpoint folder it saves into included."""
    resumed = validate_settings({"model": "tiny", "training": {"steps": 40},
                                 "checkpoint": {"dir": "ck", "resume": "ck/step-000020"}})
    loaded = load_preset(save_preset(resumed, tmp_path / "p.yaml"))
    assert loaded.checkpoint.resume is None
    assert "step-000020" not in (tmp_path / "p.yaml").read_text()
    assert loaded.checkpoint.dir == "ck"
    assert loaded.training.steps == 40


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_presets_survive_a_round_trip(tmp_path, name):
    original = load_preset(find_preset(name))
    assert load_preset(save_preset(original, tmp_path / "copy.yaml")) == original


# --- saving: atomic, never a silent overwrite ---------------------------------------------


def test_save_refuses_to_overwrite_unless_asked(tmp_path):
    path = write(tmp_path, "# my tuned preset\nversion: 1\n", "mine.yaml")
    with pytest.raises(FileExistsError):
        save_preset(Settings(model="tiny"), path)
    assert path.read_text() == "# my tuned preset\nversion: 1\n"
    save_preset(Settings(model="tiny"), path, overwrite=True)
    assert load_preset(path).model == "tiny"


def test_a_new_preset_is_readable_by_others_and_an_overwrite_keeps_the_mode(tmp_path):
    fresh = save_preset(Settings(), tmp_path / "fresh.yaml")
    assert fresh.stat().st_mode & 0o777 == 0o644
    kept = write(tmp_path, "version: 1\n", "kept.yaml")
    kept.chmod(0o600)
    save_preset(Settings(), kept, overwrite=True)
    assert kept.stat().st_mode & 0o777 == 0o600


def test_save_into_a_missing_folder_fails_cleanly(tmp_path):
    with pytest.raises(OSError):
        save_preset(Settings(), tmp_path / "no" / "such" / "p.yaml")
    assert list(tmp_path.iterdir()) == []


def _no_temp_files(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_failed_flush_to_disk_leaves_the_old_file_and_no_debris(tmp_path, monkeypatch, overwrite):
    old = "# tuned by hand\nversion: 1\nmodel: opt-1.3b\n"
    path = write(tmp_path, old, "p.yaml")
    target = path if overwrite else tmp_path / "new.yaml"

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(presets.os, "fsync", disk_full)
    with pytest.raises(OSError) as caught:
        save_preset(Settings(model="tiny"), target, overwrite=overwrite)
    assert caught.value.errno == errno.ENOSPC
    assert path.read_text() == old
    assert not (tmp_path / "new.yaml").exists()
    assert _no_temp_files(tmp_path)


def test_a_write_cut_short_by_the_kernel_leaves_the_old_file(tmp_path):
    """A real short write: the file-size limit makes write(2) fail with EFBIG mid-file."""
    old = "# tuned by hand\nversion: 1\nmodel: opt-1.3b\n"
    path = write(tmp_path, old, "p.yaml")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
    try:
        with pytest.raises(OSError) as caught:
            save_preset(Settings(model="tiny"), path, overwrite=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert caught.value.errno == errno.EFBIG
    assert path.read_text() == old
    assert _no_temp_files(tmp_path)


def test_a_file_that_appears_while_saving_is_not_overwritten(tmp_path, monkeypatch):
    """The existence check and the rename are one step: a file created in between wins."""
    path = tmp_path / "p.yaml"
    real_fsync = os.fsync

    def someone_else_saves(fd: int) -> None:
        real_fsync(fd)
        if not path.exists():
            path.write_text("# theirs\n")

    monkeypatch.setattr(presets.os, "fsync", someone_else_saves)
    with pytest.raises(FileExistsError):
        save_preset(Settings(), path)
    assert path.read_text() == "# theirs\n"
    assert _no_temp_files(tmp_path)


def test_lora_targets_may_be_a_yaml_list_of_module_names(tmp_path):
    path = write(tmp_path, "version: 1\ntraining:\n  lora:\n    rank: 4\n"
                           "    targets: [q_proj, v_proj]\n")
    lora = load_preset(path).training.lora
    assert lora.targets == "q_proj,v_proj"
    assert lora.as_lora().targets == ("q_proj", "v_proj")
    alone = write(tmp_path, "version: 1\ntraining:\n  lora:\n    rank: 4\n"
                            "    targets: [all-linear]\n", name="alone.yaml")
    assert load_preset(alone).training.lora.targets == "all-linear"


@pytest.mark.parametrize(("targets", "got"), [
    ("[q_proj, 3]", "(got a list holding 3)"),
    ("[]", "(got an empty list)"),
    ("[q_proj, v proj]", "(got a list holding 'v proj')"),
    ("[q_proj, all-linear]", "(got a list holding 'all-linear')"),
    ('["q_proj,v_proj", k_proj]', "(got a list holding 'q_proj,v_proj')"),
])
def test_a_list_of_lora_targets_that_are_not_module_names_is_named_by_file_and_key(
        tmp_path, targets, got):
    path = write(tmp_path, f"version: 1\ntraining:\n  lora:\n    rank: 4\n"
                           f"    targets: {targets}\n")
    with pytest.raises(PresetError) as caught:
        load_preset(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: training.lora.targets: must be all-linear or module "
                              f"names") and message.endswith(got)
