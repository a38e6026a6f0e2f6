"""One ``step`` signature per role (DESIGN.md, "Layout"): every layer and block ``step(x, state, tier)``, every
model ``step(tokens, cache)``, every runner ``step(tokens)`` (keyword-only hints allowed). The classes are found
by walking the package, so a new class with another order fails here."""

import importlib
import inspect
import pkgutil

import torch

from elastic_ssm.models.base import ElasticModel

PACKAGES = ("elastic_ssm.layers", "elastic_ssm.models", "elastic_ssm.serve")


def _classes_with_step():
    for pkg in PACKAGES:
        path = importlib.import_module(pkg).__path__
        for info in pkgutil.walk_packages(path, prefix=f"{pkg}."):
            module = importlib.import_module(info.name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ == module.__name__ and "step" in vars(cls):
                    yield cls


def _role(cls) -> tuple[str, ...]:
    if issubclass(cls, ElasticModel):
        return ("tokens", "cache")
    if issubclass(cls, torch.nn.Module) or cls.__module__.startswith("elastic_ssm.layers."):
        return ("x", "state", "tier")
    return ("tokens",)


def test_every_step_follows_its_role():
    seen, wrong = set(), []
    for cls in _classes_with_step():
        params = list(inspect.signature(vars(cls)["step"]).parameters.values())[1:]
        positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        seen.add(cls.__name__)
        if positional != _role(cls):
            wrong.append(f"{cls.__module__}.{cls.__name__}.step{positional}: want {_role(cls)}")
    assert not wrong, "\n".join(wrong)
    # every role was found (a walk that found nothing would pass vacuously)
    assert {"SpectralMixer", "SlidingWindowAttention", "SpectralSublayer", "ESSSMBlock", "ESSHBlock", "ESSH",
            "ESSSM", "TransformerPP", "FastDecoder", "ReferenceSession"} <= seen, sorted(seen)
