#!/usr/bin/env python3
# tools/emulate_gather_stages.py: emulates, on the CPU, the schedule of sdm_gather_whole_rows_staged
# (sdm/sdm_op_common.cuh) for one lane of every warp, against the loop of sdm_gather_whole_rows, at random entry
# counts n, row widths d (multiples of 8), vector widths V (8: bf16 bank, 4: fp32), SDM_GQ and ring depths.
# Checks: (1) every consumed stage holds the (entry, pass) slice the consumer means, with every copy into it landed
# (cp.async.wait_group N: all but this thread's newest N commit groups complete; copies land at the latest at that
# wait, and a copy issued into a stage is modelled as clobbering it at once, the worst case), and no copy
# overwrites a stage between its issue and its read; (2) per column, the sequence of (entry, gath) fmaf steps equals
# the plain loop's; (3) per entry, the dot's per-lane terms (column groups in order), then the passes in order, equal
# the plain loop's; (4) the snapshot stores (entry, column) are the same set; (5) the partial row is written for the
# same columns (all of them, zeros for a warp without entries); (6) the slot each item uses (a shuffle from the lane
# that loaded it up front, or a load past the 32nd entry of a warp) is the entry's. Prints a summary; exits 1 on a
# mismatch (an assertion: a stage read before its copy landed or overwritten before it was read).
import random
import sys

WARPS = 8


def plain(n, d, V, GQ, slots, lane, warp):
    """Events of sdm_gather_whole_rows for (warp, lane): per column the entry sequence, per entry the dot terms."""
    nq = (d + 32 * V - 1) // (32 * V)
    acc_seq, dot_seq, snaps, part_cols = {}, {}, set(), set()
    for q0 in range(0, nq, GQ):
        for k0 in range(warp, n, 2 * WARPS):
            ks = [k0, k0 + WARPS]
            sl = [slots[k] if k < n else -1 for k in ks]
            pd = [[], []]
            for j in range(2):
                for u in range(GQ):
                    col = ((q0 + u) * 32 + lane) * V
                    if sl[j] < 0 or q0 + u >= nq:
                        continue
                    on = col < d
                    if on:
                        for i in range(V):
                            acc_seq.setdefault(col + i, []).append(ks[j])
                        pd[j].append(col)
                    snaps.add((ks[j], col, on))
            for j in range(2):
                if ks[j] >= n:
                    continue
                dot_seq.setdefault(ks[j], []).append((q0, tuple(pd[j])))
        for u in range(GQ):
            col = ((q0 + u) * 32 + lane) * V
            if q0 + u < nq and col < d:
                part_cols.add(col)
    return acc_seq, dot_seq, snaps, part_cols


def staged(n, d, V, GQ, NS, slots, lane, warp, rng):
    nq = (d + 32 * V - 1) // (32 * V)
    np_ = (nq + GQ - 1) // GQ
    nm = (n - warp + WARPS - 1) // WARPS if warp < n else 0
    acc_seq, dot_seq, snaps, part_cols = {}, {}, set(), set()
    if nm == 0:
        for q in range(nq):
            col = (q * 32 + lane) * V
            if col < d:
                part_cols.add(col)
        return acc_seq, dot_seq, snaps, part_cols, 0
    items = np_ * nm
    # the slot (and weight) source: lane j holds entry warp + 8 j's for j < nm, shuffled from lane m & 31; m >= 32
    # loads it
    my_sl = [slots[warp + j * WARPS] if j < nm else -1 for j in range(32)]

    def slot_of(m):
        v = my_sl[m & 31]
        return v if m < 32 else slots[warp + m * WARPS]
    # stage state: stage -> (item, landed?) ; groups: list of lists of (stage, item)
    stage = [None] * NS
    groups = []
    pending = []  # indices of groups not yet complete
    max_inflight = 0

    def issue(it):
        g = []
        if it < items:
            p, k = it // nm, warp + (it % nm) * WARPS
            assert slot_of(it % nm) == slots[k]
            if slot_of(it % nm) >= 0:
                for u in range(GQ):
                    q = p * GQ + u
                    col = (q * 32 + lane) * V
                    if q < nq and col < d:
                        g.append((it % NS, it, u))
        for (s, item, u) in g:
            cur = stage[s]
            # the stage must not hold an item issued but not yet read
            if cur is not None and cur[1] != 'read' and cur[0] != item:
                raise AssertionError(f"stage {s} overwritten by item {item} before item {cur[0]} was read")
            stage[s] = (item, 'inflight')
        groups.append(g)
        pending.append(len(groups) - 1)

    def wait(N):
        # all but the newest N groups complete; a random subset of the newest may complete too
        while len(pending) > N:
            gi = pending.pop(0)
            for (s, item, u) in groups[gi]:
                if stage[s][0] == item:
                    stage[s] = (item, 'landed')

    for it in range(NS - 1):
        issue(it)
    acc = None
    for it in range(items):
        issue(it + NS - 1)
        wait(NS - 1)
        max_inflight = max(max_inflight, sum(1 for gi in pending if groups[gi]))
        p, m = it // nm, it % nm
        k, q0 = warp + m * WARPS, p * GQ
        sl = slot_of(m)
        assert sl == slots[k]
        pd = []
        used = False
        for u in range(GQ):
            col = ((q0 + u) * 32 + lane) * V
            if sl < 0 or q0 + u >= nq:
                continue
            on = col < d
            if on:
                s = it % NS
                assert stage[s] == (it, 'landed'), f"item {it} reads stage {s} holding {stage[s]}"
                used = True
                for i in range(V):
                    acc_seq.setdefault(col + i, []).append(k)
                pd.append(col)
            snaps.add((k, col, on))
        if used:
            stage[it % NS] = (it, 'read')
        dot_seq.setdefault(k, []).append((q0, tuple(pd)))
        if m == nm - 1:
            for u in range(GQ):
                col = ((q0 + u) * 32 + lane) * V
                if q0 + u < nq and col < d:
                    part_cols.add(col)
    wait(0)
    return acc_seq, dot_seq, snaps, part_cols, max_inflight


def main():
    rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    cases = 0
    inflight_seen = {}
    for trial in range(3000):
        n = rng.choice([1, 3, 7, 8, 9, 16, 17, 33, 64, 65, 100, 128, 256, 257, 300, 1024]) if trial % 2 else \
            rng.randint(1, 140)
        d = 8 * rng.randint(1, 300)
        V = rng.choice([4, 8])
        GQ = rng.choice([1, 2, 4])
        NS = rng.choice([2, 3, 4, 5, 8])
        slots = [rng.randint(0, 50) if rng.random() > 0.2 else -1 for _ in range(n)]
        if rng.random() < 0.3:
            slots = [slots[0]] * n  # repeated slots
        lanes = [0, 31, rng.randint(0, 31)]
        for warp in range(WARPS):
            for lane in lanes:
                a = plain(n, d, V, GQ, slots, lane, warp)
                b = staged(n, d, V, GQ, NS, slots, lane, warp, rng)
                for what, x, y in zip(("accumulation order", "dot terms", "snapshot stores", "partial row"), a, b[:4]):
                    if x != y:
                        print(f"MISMATCH {what}: n={n} d={d} V={V} GQ={GQ} NS={NS} warp={warp} lane={lane}")
                        sys.exit(1)
                inflight_seen[NS] = max(inflight_seen.get(NS, 0), b[4])
        cases += 1
    # the flagship shapes, with the shipped SDM_GQ = 4 and SDM_GATHER_STAGES = 4
    for V, name in ((8, "bf16 bank"), (4, "fp32 G")):
        slots = list(range(64))
        for warp in range(WARPS):
            for lane in range(32):
                a = plain(64, 1024, V, 4, slots, lane, warp)
                b = staged(64, 1024, V, 4, 4, slots, lane, warp, rng)
                assert a == b[:4], (name, warp, lane)
        print(f"  flagship d=1024 W=64 {name}: every lane of every warp the same order; slices in flight per lane "
              f"while one is summed: {b[4]}")
    print(f"  {cases} random cases x 8 warps x 3 lanes: every consumed stage held its (entry, pass) slice, landed and "
          f"not overwritten; accumulation order, dot terms, snapshot stores and partial rows = the plain loop's")
    print("  most slices in flight per lane while one is summed, by ring depth:", dict(sorted(inflight_seen.items())))


if __name__ == "__main__":
    main()
