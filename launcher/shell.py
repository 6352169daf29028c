"""Shell words for generated scripts and commands, with the job-time placeholders a Slurm task
resolves on its node."""
from __future__ import annotations

import re
import shlex

PLACEHOLDERS = ("MASTER_ADDR", "RUN_ID")


def shell_word(arg: str) -> str:
    """`arg` as one shell word: literal text quoted with shlex.quote, except the job-time
    placeholders ${MASTER_ADDR} and ${RUN_ID}, which stay expandable inside double quotes."""
    pattern = r"(\$\{(?:" + "|".join(PLACEHOLDERS) + r")\})"
    parts = re.split(pattern, arg)
    if len(parts) == 1:
        return shlex.quote(arg)
    literal = [p for i, p in enumerate(parts) if i % 2 == 0]
    if not any(re.search(r'["$`\\!]', p) for p in literal) and all(
            shlex.quote(p) == p for p in literal if p):
        return f'"{arg}"'
    return "".join(f'"{p}"' if i % 2 else (shlex.quote(p) if p else "") for i, p in enumerate(parts))


def resolve(arg: str, values: dict) -> str:
    for name, value in values.items():
        arg = arg.replace("${" + name + "}", value)
    return arg
