"""Every model-config field added since commit ff49162 is declared in ``added_fields`` (CONTRIBUTING rule 4).

A run saved before a field existed lacks it in ``run.yaml`` and in its checkpoints' ``model_config``; resume
fills in the declared value (``ModelConfig.upgrade_record``). A field added without a declaration makes every
older run of that architecture unresumable ("written by an older elastic_ssm"), which only
``tests/train/test_legacy_run.py`` would notice, and only for ESSH. ``tests/fixtures/legacy_fields.json``
lists each architecture's fields at ff49162.
"""

import dataclasses
import json
from pathlib import Path

import pytest

from elastic_ssm.config import model_configs

OLD = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "legacy_fields.json").read_text())["fields"]


@pytest.mark.parametrize("arch", sorted(OLD))
def test_fields_added_since_ff49162_are_declared_with_their_old_behaviour(arch):
    cls = model_configs()[arch]
    now = {f.name for f in dataclasses.fields(cls)}
    undeclared = sorted(now - set(OLD[arch]) - set(cls.added_fields))
    assert not undeclared, (f"{cls.__name__} has fields that runs saved before them lack: {undeclared}; add each "
                            "to added_fields with the value that behaves as the code did without it")
    assert set(cls.added_fields) <= now, "added_fields names a field the class does not have"


@pytest.mark.parametrize("arch", sorted(OLD))
def test_an_old_record_upgraded_builds_the_config_it_meant(arch):
    """A record with only the old fields (today's defaults as their values) plus the declared added values
    loads, and its added fields hold exactly the declared values."""
    cls = model_configs()[arch]
    old_record = {k: v for k, v in cls().to_dict().items() if k in OLD[arch]}
    cfg = cls.from_dict(cls.upgrade_record(old_record))
    assert {k: cfg.to_dict()[k] for k in cls.added_fields} == cls.added_fields
