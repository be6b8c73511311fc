"""The server-wide line (`ticket_line.py`) the admission waits share: ordered by priority then arrival across
processes, a ticket left is gone, a killed process's ticket skipped and removed."""

import os
import signal
import subprocess
import sys

from specdec.triton.admission.ticket_line import TicketLine


def test_tickets_go_in_arrival_order_across_lines(tmp_path):
    here, there = TicketLine(tmp_path / "line"), TicketLine(tmp_path / "line")
    assert not here.waiting() and here.first() is None
    a, b, c = here.join(), there.join(), here.join()
    assert here.first() == there.first() == a.name
    here.leave(a)
    assert here.first() == there.first() == b.name
    there.leave(b)
    here.leave(c)
    assert not there.waiting() and os.listdir(tmp_path) == ["line"]  # nothing left beside it either


def test_a_lower_priority_value_goes_first_then_arrival(tmp_path):
    here, there = TicketLine(tmp_path / "line"), TicketLine(tmp_path / "line")
    late = [here.join(0), there.join(2**31 - 1), here.join(7), there.join(-2**31), here.join(0), there.join(-1)]
    order = []
    while here.waiting():
        name = here.first()
        (ticket,) = [t for t in late if t.name == name]
        order.append(late.index(ticket))
        (here if ticket in late[::2] else there).leave(ticket)
    assert order == [3, 5, 0, 4, 2, 1]


def test_the_first_here_is_the_process_own_best_ticket(tmp_path):
    line = TicketLine(tmp_path / "line")
    a = line.join(3)
    assert line.holds() and line.first_here(a.name)
    b = line.join(1)
    assert line.first_here(b.name) and not line.first_here(a.name)
    line.leave(b)
    assert line.first_here(a.name)
    line.leave(a)
    assert not line.holds()


def test_a_killed_process_ticket_is_skipped_and_removed(tmp_path):
    code = ("import sys, time; from pathlib import Path; from specdec.triton.admission.ticket_line import TicketLine; "
            "TicketLine(Path(sys.argv[1])).join(); print('in line', flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "line")], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "in line"
        line = TicketLine(tmp_path / "line")
        mine = line.join()
        assert line.first() != mine.name  # the other process came first and still waits
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    assert line.first() == mine.name and os.listdir(tmp_path / "line") == [mine.name]
    line.leave(mine)
    assert not line.waiting()
