"""Profiles: what ``tree-attn tune`` measured (or the model derived) for one machine, as YAML.

A profile holds the kernel config per shape bucket and the reduction plan, each with how it was
chosen (measured, model, default), for the machine whose topology fingerprint it names. Built-in
profiles (model-derived, not measured) ship in ``tree_attn/profiles/builtin/``; tuned ones live in
the user's cache folder (:func:`default_profile_dir`). No torch is imported here.
"""

from .builtin import builtin_profile_for, list_builtin_profiles, load_builtin, open_profile
from .matching import (
    RETUNE_HINT,
    check_profile_for,
    current_versions,
    driver_version,
    machine_differences,
    profile_matches,
    version_warnings,
)
from .schema import (
    CHOSEN_BY,
    DEVICE_KINDS,
    DTYPES,
    ORIGINS,
    SCHEMA_VERSION,
    KernelBucket,
    KernelSection,
    Machine,
    PlanCandidate,
    Profile,
    Reduction,
    Versions,
    normalize_dtype,
    shard_bucket,
    utc_now,
)
from .store import (
    PROFILE_DIR_ENV,
    ProfileEntry,
    default_profile_dir,
    find_saved_profile,
    list_saved_profiles,
    load_profile,
    profile_from_yaml,
    profile_path_for,
    profile_to_yaml,
    save_profile,
)

__all__ = [
    "CHOSEN_BY", "DEVICE_KINDS", "DTYPES", "ORIGINS", "PROFILE_DIR_ENV", "RETUNE_HINT", "SCHEMA_VERSION",
    "KernelBucket", "KernelSection", "Machine", "PlanCandidate", "Profile", "ProfileEntry", "Reduction", "Versions",
    "builtin_profile_for", "check_profile_for", "current_versions", "default_profile_dir", "driver_version",
    "find_saved_profile", "list_builtin_profiles", "list_saved_profiles", "load_builtin", "load_profile",
    "machine_differences", "normalize_dtype", "open_profile", "profile_from_yaml", "profile_matches",
    "profile_path_for", "profile_to_yaml", "save_profile", "shard_bucket", "utc_now", "version_warnings",
]
