"""docs/policy.md is generated from the policy schema and kept in step with it: every key there, with its type,
default and meaning; the page in the repository is exactly what the generator prints."""
from pathlib import Path

import importlib.util

from restartkit.policy import SCHEMA

PAGE = Path(__file__).resolve().parent.parent.parent / "docs" / "policy.md"
_spec = importlib.util.spec_from_file_location("policydoc", PAGE.parent.parent / "scripts" / "policydoc.py")
policydoc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(policydoc)
render = policydoc.render


def test_the_policy_page_is_the_schemas():
    assert PAGE.read_text() == render(), "docs/policy.md is stale: python scripts/policydoc.py > docs/policy.md"


def test_every_key_is_on_the_page_with_a_meaning():
    text = render()
    for section, keys in SCHEMA.items():
        assert f"## [{section}]" in text
        for name, key in keys.items():
            assert f"| `{name}` |" in text and key.doc, (section, name)


def test_the_readme_shows_the_demo_policy_whole_and_ci_runs_its_test_command():
    root = PAGE.parent.parent
    readme = (root / "README.md").read_text()
    shown = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    assert shown == (root / "policies" / "demo.toml").read_text()
    command = next(ln for ln in readme.splitlines() if "pytest" in ln and ln.startswith("bash scripts/setup"))
    assert command.split("#")[0].strip() in (root / ".ci" / "run").read_text()
    assert len(readme.splitlines()) <= 200
