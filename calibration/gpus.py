"""GPU names: from what the data says (a device name, a folder or file name) to a profile name,
and the datasheet profile a fit starts from."""
from __future__ import annotations

import re

from sim.errors import ConfigError

# Markers are matched case-insensitively, most specific first.
KNOWN_GPUS = (("H200", "h200"), ("H100", "h100"), ("B200", "b200"), ("A100-SXM4-40GB", "a100_40g"),
              ("A100-SXM4-80GB", "a100_80g"), ("A100 80GB", "a100_80g"), ("A100", "a100_40g"),
              ("L40S", "l40s"), ("MI300X", "mi300x"))


def profile_name(gpu_name: str) -> str:
    """A profile name for a GPU's name: a known one, else the name in lower case with underscores."""
    upper = gpu_name.upper()
    for marker, name in KNOWN_GPUS:
        if marker in upper:
            return name
    return re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_")


def base_profile(base: str | None, name: str, gpu_names: list[str], packaged: list[str]) -> str:
    """The datasheet profile a fit starts from: base= if given, else the one named like the new
    profile, else the one the data's GPU name points to; otherwise one line saying to choose."""
    if base:
        return base
    if name in packaged:
        return name
    for gpu in gpu_names:
        guess = profile_name(gpu)
        if guess in packaged:
            return guess
    raise ConfigError(f"no datasheet profile matches GPU {', '.join(gpu_names) or 'unknown'} or name "
                      f"'{name}', key base, give base=<one of {', '.join(packaged)}> (the datasheet "
                      f"figures the fit starts from)")


def check_profile_name(name: str, gpu_names: list[str], packaged: list[str]) -> None:
    """One GPU per profile; a name that is a file name; a packaged GPU's name only for its data."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise ConfigError(f"profile name '{name}' is not a plain file name, key name, "
                          f"use letters, digits, '_', '-' and '.' (e.g. name=my_h100)")
    if len(gpu_names) > 1:
        raise ConfigError(f"the data comes from several GPUs ({', '.join(gpu_names)}), key name, "
                          f"fit one GPU's measurements at a time")
    measured = profile_name(gpu_names[0]) if gpu_names else None
    family = (lambda profile: profile.split("_")[0])  # a100_40g and a100_80g: one family
    if name in packaged and measured in packaged and family(measured) != family(name):
        raise ConfigError(f"name={name} is the packaged {name} profile but the data was measured "
                          f"on {gpu_names[0]}, key name, use name={measured} or a name of your own")
