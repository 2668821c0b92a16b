"""`--help` text, read from the config files themselves: each command, each config group with its
options and their first comment line, the GPU profiles, and every commented key."""
from __future__ import annotations

import re
from importlib import resources

CONFIG_MODULE = "scenarios"
KEY_LINE = re.compile(r"^(\s*)([A-Za-z_][\w]*):\s*(.*?)\s+#\s*(.*)$")
SENTENCE_END = re.compile(r"(?<!\bal)(?<!e\.g)(?<!i\.e)\.(\s|$)")  # not 'et al.', 'e.g.', 'i.e.'
PARENT_LINE = re.compile(r"^(\s*)([A-Za-z_][\w]*):\s*(?:#.*)?$")  # a mapping: its keys follow


def _first_comment(text: str, name: str = "", limit: int = 160) -> str:
    """The file's leading comment up to its first full stop, on one line, without a leading
    'name:' (the option is listed beside it)."""
    words = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("#"):
            break
        if "@package" not in line:
            words.append(line.lstrip("# ").rstrip())
            if SENTENCE_END.search(" ".join(words)):
                break
    joined = " ".join(words).removeprefix(f"{name}: ")
    match = SENTENCE_END.search(joined)
    joined = joined[:match.start() + 1] if match else joined
    return joined if len(joined) <= limit else joined[:limit - 3].rstrip() + "..."


def group_options(group: str) -> list[tuple[str, str]]:
    """(option, one-line description) for each YAML file of a config group."""
    folder = resources.files(CONFIG_MODULE) / group
    if not folder.is_dir():
        return []
    return sorted((p.name[:-5], _first_comment(p.read_text(), p.name[:-5])) for p in folder.iterdir()
                  if p.name.endswith(".yaml"))


def commented_keys(config_name: str) -> list[tuple[str, str, str]]:
    """(dotted key, default, comment) for each commented key of a primary config."""
    text = (resources.files(CONFIG_MODULE) / f"{config_name}.yaml").read_text()
    keys, parents = [], []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and keys and line.index("#") > 20:  # a key's comment, continued
            dotted, default, comment = keys[-1]
            keys[-1] = (dotted, default, f"{comment} {stripped.lstrip('#').strip()}")
            continue
        if stripped.startswith(("#", "-")) or not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        parents = [(i, name) for i, name in parents if i < indent]
        match = KEY_LINE.match(line)
        if match and match.group(3):
            dotted = ".".join([name for _, name in parents] + [match.group(2)])
            if not dotted.startswith("hydra"):
                keys.append((dotted, match.group(3), match.group(4)))
            continue
        parent = PARENT_LINE.match(line)
        if parent:
            parents.append((indent, parent.group(2)))
    return keys


def gpu_profiles() -> list[tuple[str, str]]:
    from sim.latency.profile import available_profiles, load_profile
    return [(name, f"{load_profile(name).gpu_name} ({load_profile(name).source})")
            for name in available_profiles()]


def _table(rows, indent: str = "  ") -> list[str]:
    width = max((len(a) for a, _ in rows), default=0)
    return [f"{indent}{a:<{width}}  {b}".rstrip() for a, b in rows]


def main_help(usage: str, descriptions: dict[str, str], program: str) -> str:
    lines = [usage, "", "commands:", *_table(descriptions.items()), "",
             f"'{program} <command> --help' lists that command's config groups, choices and keys."]
    return "\n".join(lines)


def command_help(program: str, command: str, config_name: str, description: str,
                 groups: dict[str, str], shared_keys=()) -> str:
    """groups: group name -> how it is chosen (e.g. 'model=NAME'); shared_keys: (config,
    prefix) pairs whose keys this command reads too."""
    lines = [f"usage: {program} {command} [key=value ...] [-m] [--cfg job]", "", description]
    for group, how in groups.items():
        options = gpu_profiles() if group == "gpu" else group_options(group)
        lines += ["", f"{group} ({how}):", *_table(options)]
    keys = commented_keys(config_name)
    for other, prefix in shared_keys:
        keys += [k for k in commented_keys(other) if k[0].startswith(prefix)]
    if keys:
        lines += ["", "keys (key=value; default, then meaning):",
                  *_table([(f"{k}={v}", c) for k, v, c in keys])]
    return "\n".join(lines)
