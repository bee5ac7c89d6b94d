"""``fsdpx schedule``: a pipeline schedule simulated and shown, from the command line.

    fsdpx schedule 1f1b --ranks 4 --microbatches 8                  # text timeline, bubble 3/11
    fsdpx schedule interleaved_1f1b --ranks 2 --microbatches 4 --virtual 2 --png t.png
    fsdpx schedule zero_bubble --ranks 4 --microbatches 8 --costs F=2,B=2,W=1 --transit 1
    fsdpx schedule gpipe --ranks 4 --microbatches 8 --cores 2       # 4 ranks sharing 2 cores
    fsdpx schedule 1f1b --ranks 4 --microbatches 8 --costs B=2 --private   # W's fill the waits

Prints the timeline (one line per rank, when every time is an integer), the bubble (exactly,
as a fraction, for integer or fractional costs), the makespan and the peak microbatches in
flight per rank; ``--png`` draws the Gantt chart. ``--private`` runs it as a private pipeline:
each ``W`` (a microbatch's clipped sums at a stage) after its norms' all-reduce (``--norms``,
its time), filling waits (``fsdpx.sharding.private_sim``). Everything comes from
``fsdpx.sharding.schedule.schedule`` and ``fsdpx.sharding.schedule_sim.simulate`` /
``simulate_private``: this file only parses and prints.
"""

from __future__ import annotations

import argparse
from fractions import Fraction
from typing import TYPE_CHECKING

# Only light modules here: the parser answers (``--help``, a bad flag) before the sharding
# package (torch) is imported, in the functions that simulate.
from .flags import FlagParser
from .layout import SCHEDULES

if TYPE_CHECKING:
    from fsdpx.sharding.schedule_sim import Timeline


def parse_costs(spec: str) -> dict[str, Fraction]:
    """``"F=1,B=2,W=1/2"`` -> ``{"F": 1, "B": 2, "W": 1/2}`` as exact fractions (decimals too:
    ``0.5``). ``ValueError`` naming the bad item for an unknown kind, a negative or unparsable
    cost (``tests/test_schedule_cli.py``)."""
    from fsdpx.sharding.schedule import ACTION_KINDS

    costs: dict[str, Fraction] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, eq, value = item.partition("=")
        kind = kind.strip().upper()
        if not eq or kind not in ACTION_KINDS:
            raise ValueError(f"cost {item!r}: expected KIND=VALUE with KIND one of {', '.join(ACTION_KINDS)}")
        try:
            cost = Fraction(value.strip())
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"cost {item!r}: {value.strip()!r} is not a number") from None
        if cost < 0:
            raise ValueError(f"cost {item!r}: must be >= 0")
        costs[kind] = cost
    return costs


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="fsdpx schedule", description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=SCHEDULES, help="the schedule")
    p.add_argument("--ranks", type=int, required=True, metavar="P", help="pipeline ranks (stages per round)")
    p.add_argument("--microbatches", type=int, required=True, metavar="M")
    p.add_argument("--virtual", type=int, default=1, metavar="V", help="chunks per rank (interleaved_1f1b)")
    p.add_argument("--costs", default="", metavar="K=X,...",
                   help="action costs by kind, F/B/W default 1, transfers 0 (e.g. F=1,B=2,W=1/2)")
    p.add_argument("--transit", default="0", metavar="D", help="each message's time between ranks (default 0)")
    p.add_argument("--cores", type=int, default=None, metavar="C",
                   help="the ranks share C cores (default: a core each)")
    p.add_argument("--private", action="store_true",
                   help="a private pipeline: each W after its microbatch's norms, filling waits for messages")
    p.add_argument("--norms", default="0", metavar="D", help="with --private: the norms' all-reduce time (default 0)")
    p.add_argument("--png", metavar="PATH", help="also draw the Gantt chart to this PNG")
    return p


def describe(timeline: Timeline) -> str:
    """What ``fsdpx schedule`` prints for ``timeline``: the text timeline when every time is an
    integer, then the bubble (exact fraction and percent), makespan and peak in flight."""
    from fsdpx.sharding.schedule_sim import text

    lines = []
    try:
        lines += [text(timeline), ""]
    except ValueError:  # fractional times: the chart (--png) shows them
        pass
    p = timeline.schedule.num_ranks
    bubble = Fraction(timeline.idle_time) / (p * Fraction(timeline.makespan)) if timeline.makespan else Fraction(0)
    lines.append(f"bubble {bubble} = {float(bubble):.1%} of {p} ranks x makespan {timeline.makespan}")
    lines.append("peak microbatches in flight per rank: " + " ".join(map(str, timeline.peak_in_flight_by_rank)))
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """Run ``fsdpx schedule`` on ``argv`` (the words after ``schedule``). Exits with status 2 and
    a message naming the problem for bad counts, costs or a kind's constraints (interleaved:
    microbatches a multiple of ranks)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from fsdpx.sharding.private_sim import simulate_private
    from fsdpx.sharding.schedule import schedule
    from fsdpx.sharding.schedule_sim import Transfer, plot, simulate

    try:
        costs = parse_costs(args.costs)
        transit = Fraction(args.transit)
        sched = schedule(args.kind, args.ranks, args.microbatches, virtual_stages=args.virtual)
        if args.private:
            timeline = simulate_private(sched, costs, transfer=Transfer(latency=transit), cores=args.cores,
                                        norms=Fraction(args.norms))
        elif args.norms != "0":
            raise ValueError("--norms needs --private")
        else:
            timeline = simulate(sched, costs, transfer=Transfer(latency=transit), cores=args.cores)
    except (ValueError, TypeError, ZeroDivisionError) as e:
        parser.error(str(e))
    print(describe(timeline))
    if args.png:
        plot(timeline, args.png)
        print(f"wrote {args.png}")
