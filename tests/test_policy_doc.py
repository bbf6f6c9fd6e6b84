"""docs/policy.md is generated from the policy schema and kept in step with it: every key there, with its type,
default and meaning; the page in the repository is exactly what the generator prints."""
from pathlib import Path

from restartkit.policy import SCHEMA
from restartkit.policydoc import render

PAGE = Path(__file__).resolve().parent.parent / "docs" / "policy.md"


def test_the_policy_page_is_the_schemas():
    assert PAGE.read_text() == render(), "docs/policy.md is stale: python -m restartkit.policydoc > docs/policy.md"


def test_every_key_is_on_the_page_with_a_meaning():
    text = render()
    for section, keys in SCHEMA.items():
        assert f"## [{section}]" in text
        for name, key in keys.items():
            assert f"| `{name}` |" in text and key.doc, (section, name)
