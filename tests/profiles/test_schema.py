"""Profile schema: round trip, and every kind of bad YAML refused with the field named."""

from __future__ import annotations

import copy

import pytest
import yaml

from tests.bad_files import refused
from tree_attn.errors import ProfileError
from tree_attn.kernels.config import DecodeConfig
from tree_attn.profiles import (
    KernelBucket,
    Machine,
    PlanCandidate,
    Profile,
    Reduction,
    load_profile,
    profile_from_yaml,
    profile_to_yaml,
    save_profile,
    shard_bucket,
)
from tree_attn.reduce.plan import ReductionPlan
from tree_attn.topology import host_topology

from .conftest import make_profile


def test_round_trip_file(profile, tmp_path):
    path = save_profile(profile, tmp_path / "p.yaml")
    back = load_profile(path)
    assert back == profile
    assert back.to_dict() == profile.to_dict()
    # Writing it again gives the same bytes: the key order is stable.
    assert profile_to_yaml(back) == path.read_text()


@pytest.mark.parametrize("origin", ["measured", "model"])
def test_round_trip_without_topology(origin):
    prof = make_profile(3, origin=origin, with_topology=False)
    assert profile_from_yaml(profile_to_yaml(prof)) == prof


def test_file_order_and_every_value_says_how_chosen(profile):
    d = yaml.safe_load(profile_to_yaml(profile))
    assert list(d)[:4] == ["schema_version", "name", "origin", "created"]
    assert d["reduction"]["chosen_by"] == "measured"
    assert all("chosen_by" in b for b in d["kernel"]["buckets"])
    assert all("chosen_by" in c for c in d["reduction"]["candidates"])
    assert d["machine"]["hierarchy"] == ["sys:[0-3]"]
    assert d["machine"]["link_classes"] == {"sys": 6}


def _mutated(profile, edit):
    d = copy.deepcopy(profile.to_dict())
    edit(d)
    return yaml.safe_dump(d, sort_keys=False)


def _set(path, value):
    def edit(d):
        keys = path.split(".")
        node = d
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        last = keys[-1]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return edit


def _delete(path):
    def edit(d):
        keys = path.split(".")
        node = d
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        del node[keys[-1]]
    return edit


def _both(a, b):
    def edit(d):
        a(d)
        b(d)
    return edit


BAD = [
    # (edit, field path named in the message, a word of the reason)
    (_set("colour", "blue"), "colour", "unknown key"),
    (_set("reduction.plan.colour", 3), "reduction.plan.colour", "unknown key"),
    (_set("kernel.buckets.0.config.tile", 3), "kernel.buckets[0].config.tile", "unknown key"),
    (_set("machine.gpu_count", 8), "machine.gpu_count", "unknown key"),
    (_set("machine.world_size", "eight"), "machine.world_size", "integer"),
    (_set("kernel.buckets.0.config.block_n", "64"), "kernel.buckets[0].config.block_n", "integer"),
    (_set("kernel.buckets.1.head_dim", 12.5), "kernel.buckets[1].head_dim", "integer"),
    (_set("reduction.candidates", {"a": 1}), "reduction.candidates", "list"),
    (_set("versions.torch", 2.5), "versions.torch", "string"),
    (_set("notes", "just one"), "notes", "list"),
    (_set("reduction.candidates.1.selected", "yes"), "reduction.candidates[1].selected", "true or false"),
    (_set("schema_version", 2), "schema_version", "schema 1"),
    (_set("schema_version", "1"), "schema_version", "integer"),
    (_set("reduction.plan.fanout", 1), "reduction.plan.fanout", ">= 2"),
    (_set("reduction.candidates.0.median_us", -3.0), "reduction.candidates[0].median_us", ">= 0"),
    (_set("reduction.candidates.0.p95_us", 1.0), "reduction.candidates[0].p95_us", "median"),
    (_set("kernel.buckets.0.time_us", -1), "kernel.buckets[0].time_us", ">= 0"),
    (_set("kernel.buckets.0.gbps", float("nan")), "kernel.buckets[0].gbps", "finite"),
    (_set("kernel.buckets.0.dtype", "bfloat17"), "kernel.buckets[0].dtype", "bfloat17"),
    (_set("kernel.buckets.0.max_shard_len", 10000), "kernel.buckets[0].max_shard_len", "power of two"),
    (_set("kernel.buckets.0.config.block_n", 48), "kernel.buckets[0].config.block_n", "power of two"),
    (_set("kernel.buckets.0.config.num_warps", 64), "kernel.buckets[0].config.num_warps", "64"),
    (_set("kernel.buckets.1.max_shard_len", 8192), "kernel.buckets[1]", "duplicate"),
    (_set("kernel.buckets.0.chosen_by", "guess"), "kernel.buckets[0].chosen_by", "guess"),
    (_set("reduction.chosen_by", "luck"), "reduction.chosen_by", "luck"),
    (_set("origin", "folklore"), "origin", "folklore"),
    (_set("created", "yesterday"), "created", "ISO 8601"),
    (_set("created", "2025-03-04T05:06:07+02:00"), "created", "UTC"),
    (_set("machine.device_kind", "tpu"), "machine.device_kind", "tpu"),
    (_set("machine.fingerprint", "xyz"), "machine.fingerprint", "hex"),
    (_set("machine.fingerprint", "0123456789abcdef"), "machine.fingerprint", "topology"),
    (_set("machine.link_classes", {"sys": 5}), "machine.link_classes", "pairs"),
    (_set("machine.link_classes", {"warp": 6}), "machine.link_classes.warp", "unknown key"),
    (_set("reduction.plan.strategy", "gossip"), "reduction.plan.strategy", "gossip"),
    (_both(_set("reduction.plan.parents", [-1, 0]), _set("reduction.candidates.1.plan.parents", [-1, 0])),
     "reduction.plan", "parents has 2 entries for 4 ranks"),
    (_set("reduction.plan.parents", [-1, 0, 0, 0]), "reduction.candidates[1].plan", "differs from reduction.plan"),
    (_set("reduction.candidates.1.selected", False), "reduction.candidates", "exactly one"),
    (_set("reduction.candidates.0.chosen_by", "default"), "reduction.candidates[0].chosen_by", "default"),
    (_delete("machine"), "machine", "required"),
    (_delete("reduction.plan.strategy"), "reduction.plan.strategy", "required"),
    (_set("topology.devices.0.vendor", "intel"), "topology", "vendor"),
]


@pytest.mark.parametrize("edit,field,reason", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_values_name_the_field(profile, tmp_path, edit, field, reason):
    path = tmp_path / "bad.yaml"
    msg = refused(load_profile, path, _mutated(profile, edit), ProfileError)
    assert msg.startswith(str(path)), msg
    assert f"{field}:" in msg or f"{field} " in msg or msg.endswith(field), msg
    assert reason in msg, msg


def test_yaml_syntax_error_names_file_and_line(profile, tmp_path):
    text = profile_to_yaml(profile).splitlines()
    text[5] = text[5] + " ]["  # line 6 becomes unparseable
    path = tmp_path / "broken.yaml"
    msg = refused(load_profile, path, "\n".join(text) + "\n", ProfileError)
    assert f"{path}:6:" in msg and "not valid YAML" in msg


@pytest.mark.parametrize("text,what", [("", "empty"), ("- 1\n- 2\n", "mapping"), ("just text\n", "mapping")])
def test_not_a_profile(tmp_path, text, what):
    refused(load_profile, tmp_path / "x.yaml", text, ProfileError, what)


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match="no such profile"):
        load_profile(tmp_path / "nope.yaml")


def test_unquoted_timestamp_accepted(profile):
    text = profile_to_yaml(profile).replace("created: '2025-03-04T05:06:07Z'", "created: 2025-03-04T05:06:07Z")
    assert "created: 2025-03-04T05:06:07Z" in text
    assert profile_from_yaml(text).created == "2025-03-04T05:06:07Z"


def test_direct_construction_is_validated(profile):
    with pytest.raises(ProfileError, match=r"kernel\.buckets\[\]\.group"):
        KernelBucket("bfloat16", 128, 0, 8192, DecodeConfig(), "model")
    with pytest.raises(ProfileError, match="time_us.*measured"):
        KernelBucket("bfloat16", 128, 4, 8192, DecodeConfig(), "measured")
    with pytest.raises(ProfileError, match=r"reduction.candidates\[\]\.predicted_us"):
        PlanCandidate("tree k=2", ReductionPlan("tree", 2), "model")
    with pytest.raises(ProfileError, match="machine.world_size"):
        Machine("cpu", "cpu rank", 0, "0123456789abcdef")
    # A model-derived profile cannot claim a measured value.
    with pytest.raises(ProfileError, match=r"reduction\.chosen_by.*origin 'model'"):
        Profile(**{**_fields(make_profile()), "origin": "model"})
    # A plan for the wrong number of ranks.
    plan = ReductionPlan("tree", 2, parents=(-1, 0))
    with pytest.raises(ProfileError, match="reduction.plan"):
        Profile(name="x", created="2025-01-01T00:00:00Z", origin="model",
                machine=Machine.from_topology(host_topology(4)), reduction=Reduction(plan, "model"))


def _fields(p: Profile) -> dict:
    return {f: getattr(p, f) for f in ("name", "created", "origin", "machine", "reduction", "kernel", "versions",
                                       "description", "notes", "topology", "schema_version")}


def test_dtype_aliases_normalised():
    b = KernelBucket("bf16", 128, 4, 8192, DecodeConfig(), "default")
    assert b.dtype == "bfloat16"


def test_kernel_config_for_nearest_bucket(profile):
    cfg_small = DecodeConfig(64, 4, 2, 8)
    cfg_big = DecodeConfig(64, 4, 3, 32)
    assert profile.kernel_config_for("bfloat16", 128, 4, 100) == (cfg_small, "measured")
    assert profile.kernel_config_for("bf16", 128, 4, 8192) == (cfg_small, "measured")
    assert profile.kernel_config_for("torch.bfloat16", 128, 4, 8193) == (cfg_big, "model")
    assert profile.kernel_config_for("bfloat16", 128, 4, 10**7) == (cfg_big, "model")  # larger than all: largest
    assert profile.kernel_config_for("float16", 64, 1, 5) == (DecodeConfig(128, 4, 2, None), "default")
    assert profile.kernel_config_for("bfloat16", 64, 4, 100) is None
    assert profile.kernel_config_for("float32", 128, 4, 100) is None
    with pytest.raises(ProfileError, match="dtype"):
        profile.kernel_config_for("int8", 128, 4, 100)


def test_kernel_config_for_torch_dtype(profile):
    torch = pytest.importorskip("torch")
    assert profile.kernel_config_for(torch.bfloat16, 128, 4, 1)[1] == "measured"


def test_shard_bucket():
    assert [shard_bucket(x) for x in (0, 1, 2, 3, 8192, 8193)] == [1, 1, 2, 4, 8192, 16384]
