"""Nothing is imported unless used: ``import dstt`` (and ``dstt.integrations``) pulls in no
framework, and the Trainer callback does not pull in Lightning. (The reverse cannot be
promised: Lightning itself imports transformers when it is installed.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

FRAMEWORKS = ("transformers", "lightning", "accelerate")
CODE = f"""
import sys
def show(): print(*[m in sys.modules for m in {FRAMEWORKS!r}])
import dstt, dstt.integrations
dstt.session, dstt.Session
show()
import dstt.integrations.transformers
show()
"""


def test_import_dstt_imports_no_framework_and_each_callback_only_its_own() -> None:
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    bare, with_hf = out.stdout.splitlines()
    assert bare.split() == ["False", "False", "False"]
    assert with_hf.split() == ["True", "False", "True"]
