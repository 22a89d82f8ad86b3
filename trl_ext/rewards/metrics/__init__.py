"""`evaluate` metric modules shipped with trl-ext, loadable offline from the installed package.

```python
import evaluate
from trl_ext.rewards.metrics import metric_path

f1 = evaluate.load(metric_path("char_span_f1"))
f1.compute(predictions=['["cat sat"]'], references=['[[4, 11]]'], contexts=["The cat sat on the mat."])
# {'f1': 1.0, 'precision': 1.0, 'recall': 1.0}
```

Each module is a folder holding a script of the same name (`evaluate`'s local-module layout); the scripts only
wrap `trl_ext.rewards.span_f1` and `trl_ext.rewards.rubric`, so the metric and the reward can never disagree.
"""

from __future__ import annotations

from pathlib import Path

METRICS = ("char_span_f1", "rubric_judge")


def metric_path(name: str) -> str:
    """Path of a shipped `evaluate` module, for ``evaluate.load(metric_path(name))``.

    Args:
        name: ``"char_span_f1"`` or ``"rubric_judge"``.

    Raises:
        ValueError: for another name.
        FileNotFoundError: when the installed package lacks the module files (package data not installed).
    """
    if name not in METRICS:
        raise ValueError(f"Unknown trl-ext metric {name!r}; the shipped metrics are {list(METRICS)}.")
    folder = Path(__file__).resolve().parent / name
    if not (folder / f"{name}.py").is_file():
        raise FileNotFoundError(
            f"{folder / (name + '.py')} is missing: the installed trl-ext lacks its metric files (package data). "
            "Reinstall trl-ext."
        )
    return str(folder)
