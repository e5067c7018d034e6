#!/usr/bin/env python3
"""Atomic read-modify-writes per message, from two callgrind runs (--dump-instr=yes) of
different lengths: each instruction's execution count is its Ir, so the lock-prefixed
instructions (and xchg with memory, locked implicitly) that objdump finds in each library
give how many atomic operations a message costs. Uncontended, each still takes ~20 cycles
on x86, far more than its one instruction counts.

    atomics.py SHORT.callgrind LONG.callgrind MESSAGES_BETWEEN_THEM
"""
import collections
import re
import subprocess
import sys

POSITION = re.compile(r"(c?ob)=\((\d+)\)(?: (.*))?")
FUNCTION = re.compile(r"^([0-9a-f]+) <")
INSTRUCTION = re.compile(r"^\s+([0-9a-f]+):\s+(\S+)\s*(\S*)")


def executions(path):
    """(object, address) -> times executed. Call-cost lines (after `calls=`) are inclusive
    costs of the callee, not executions of the call instruction: skipped."""
    objects, current, last = {}, None, [0, 0]
    counts = collections.Counter()
    after_call = False
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            m = POSITION.match(line)
            if m:
                if m.group(3):
                    objects[m.group(2)] = m.group(3)
                if m.group(1) == "ob":
                    current = objects[m.group(2)]
                continue
            head = line.split(" ", 1)[0]
            if "=" in head:
                after_call = line.startswith("calls=")
                continue
            if line[0] not in "0123456789+-*":
                continue
            fields = line.split()
            position = []
            for i, p in enumerate(fields[:2]):
                if p == "*":
                    position.append(last[i])
                elif p[0] in "+-":
                    position.append(last[i] + int(p, 0))
                else:
                    position.append(int(p, 0))
            last = position
            if after_call:
                after_call = False
                continue
            counts[(current, position[0])] += int(fields[2]) if len(fields) > 2 else 0
    return counts


def atomic_addresses(obj):
    """Addresses of the instructions in `obj` that are atomic read-modify-writes."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", obj],
                         capture_output=True, text=True, check=False).stdout
    found = set()
    for line in out.splitlines():
        m = INSTRUCTION.match(line)
        if not m:
            continue
        mnemonic, operands = m.group(2), m.group(3)
        if mnemonic == "lock" or (mnemonic.startswith("xchg") and "(" in operands):
            found.add(int(m.group(1), 16))
    return found


def main():
    short, long_, messages = executions(sys.argv[1]), executions(sys.argv[2]), int(sys.argv[3])
    per_object = collections.Counter()
    for obj in {o for o, _ in long_ if o and o.startswith("/")}:
        for address in atomic_addresses(obj):
            extra = long_.get((obj, address), 0) - short.get((obj, address), 0)
            if extra > 0:
                per_object[obj.rsplit("/", 1)[-1]] += extra / messages
    total = sum(per_object.values())
    parts = ", ".join(f"{name} {n:.1f}" for name, n in per_object.most_common() if n >= 0.05)
    print(f"{total:.1f} ({parts})")


if __name__ == "__main__":
    main()
