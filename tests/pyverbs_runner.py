# Runs rdma-core's pyverbs test suite (Debian's python3-pyverbs ships it, partly gzipped, in
# /usr/share/doc/rdma-core/tests) as its run_tests.py does, and writes one line per outcome to
# OUT: "<test id>\t<ok|skipped|FAIL|ERROR|xfail|unexpected-success>\t<skip reason>".
# Usage: runner.py SRC DST OUT [run_tests.py arguments]; SRC is copied into DST/tests first
# (the .gz files decompressed).
import gzip
import os
import shutil
import sys
import unittest

src, dst, out = sys.argv[1:4]
del sys.argv[1:4]
tests_dir = os.path.join(dst, 'tests')
os.makedirs(tests_dir, exist_ok=True)
for name in os.listdir(src):
    path = os.path.join(src, name)
    if name.endswith('.gz'):
        with gzip.open(path, 'rb') as f, open(os.path.join(tests_dir, name[:-3]), 'wb') as t:
            shutil.copyfileobj(f, t)
    elif os.path.isfile(path):
        shutil.copy(path, tests_dir)
sys.path.insert(0, tests_dir)

from importlib.machinery import SourceFileLoader  # noqa: E402
from args_parser import parser  # noqa: E402

tests = SourceFileLoader('tests', os.path.join(tests_dir, '__init__.py')).load_module()
parser.parse_args()
rows = []


def one_line(s):
    return ' '.join(str(s).split())


class Recording(unittest.TextTestResult):
    def addSuccess(self, test):
        super().addSuccess(test)
        rows.append((test.id(), 'ok', ''))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        rows.append((test.id(), 'skipped', one_line(reason)))

    def addFailure(self, test, err):
        super().addFailure(test, err)
        rows.append((test.id(), 'FAIL', ''))

    def addError(self, test, err):
        super().addError(test, err)
        rows.append((test.id(), 'ERROR', ''))

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            rows.append((subtest.id(), 'FAIL', ''))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        rows.append((test.id(), 'xfail', ''))

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        rows.append((test.id(), 'unexpected-success', ''))


runner = unittest.TextTestRunner(resultclass=Recording, verbosity=2)
unittest.main(module=tests, testRunner=runner, exit=False)
with open(out, 'w') as f:
    for row in rows:
        f.write('\t'.join(row) + '\n')
