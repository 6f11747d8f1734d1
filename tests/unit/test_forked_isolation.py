"""The forked isolation of `gloo_threads` tests (tests/unit/conftest.py): a test that aborts
its process fails alone and the run goes on; results of passing and failing tests come back."""
import shutil
from pathlib import Path

pytest_plugins = ["pytester"]

INNER = '''
import os
import pytest

pytestmark = pytest.mark.gloo_threads

def test_aborts():
    os.abort()  # what gloo's std::terminate does to a process

def test_fails():
    assert 1 == 2, "inner failure"

def test_passes():
    print("printed in the child")
'''


def test_an_aborting_test_fails_alone_and_the_run_goes_on(pytester):
    shutil.copyfile(Path(__file__).with_name("conftest.py"), pytester.path / "conftest.py")
    pytester.makeini("[pytest]\nmarkers =\n  gloo_threads: forked\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-rA", timeout=120)
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*_ test_aborts _*", "*killed by signal 6 before reporting*", "*inner failure*", "*printed in the child*"])
