"""docs/policy.md, generated from the policy schema (restartkit.policy.SCHEMA): every key with its type, default,
allowed values and meaning.  `.venv/bin/python scripts/policydoc.py > docs/policy.md` writes it; a test
(tests/policy/test_policy_doc.py) fails when the page in the repository differs from what this prints."""
from __future__ import annotations

import json

from restartkit.policy import SCHEMA

HEAD = """# Policy keys

<!-- Generated from restartkit/policy/__init__.py's SCHEMA by `python scripts/policydoc.py > docs/policy.md`:
     edit the schema, not this page (tests/policy/test_policy_doc.py fails when they differ). -->

One TOML file per service (examples in `policies/`).  Every key is optional but `[service] name` and `model`.
Unknown keys and wrong types are errors that name the file, the key and what is allowed; `restartkit policy check
--policy FILE` checks a file, and this host as `start` will.
"""


def _type(key) -> str:
    kinds = key.type if isinstance(key.type, tuple) else (key.type,)
    names = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "list", "dict": "table"}
    return " or ".join(dict.fromkeys(names.get(k.__name__, k.__name__) for k in kinds))


def _default(key) -> str:
    if key.default is None:
        return "(required)"
    return f"`{json.dumps(key.default)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    out = [HEAD]
    for section, keys in SCHEMA.items():
        out.append(f"\n## [{section}]\n\n| key | type | default | meaning |\n| --- | --- | --- | --- |")
        for name, key in keys.items():
            allowed = f"; one of: {', '.join(f'`{a}`' for a in key.allowed)}." if key.allowed else ""
            out.append(f"| `{name}` | {_type(key)} | {_default(key)} | {_cell(key.doc) or '-'}{allowed} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
