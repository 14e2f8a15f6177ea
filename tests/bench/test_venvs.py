"""Anchor environments are never created behind the user's back when --no-install is given."""

from __future__ import annotations

import pytest

from tokenmill.bench.venvs import VenvSpec, ensure_venv


def test_missing_venv_without_install_is_a_value_error_saying_how_to_get_it(tmp_path):
    spec = VenvSpec("demo", ("example==1.0",))
    with pytest.raises(ValueError, match="without --no-install"):
        ensure_venv(spec, tmp_path, install=False)
    assert not spec.root(tmp_path).exists()


def test_venv_with_a_matching_stamp_is_reused_without_installing(tmp_path):
    spec = VenvSpec("demo", ("example==1.0",))
    ensure_stamp = spec.root(tmp_path) / ".tokenmill-installed"
    ensure_stamp.parent.mkdir(parents=True)
    ensure_stamp.write_text(
        '{"name": "demo", "remove_after": [], "requirements": ["example==1.0"]}'
    )
    assert ensure_venv(spec, tmp_path, install=False) == spec.python(tmp_path)
    changed = VenvSpec("demo", ("example==2.0",))
    with pytest.raises(ValueError):
        ensure_venv(changed, tmp_path, install=False)
