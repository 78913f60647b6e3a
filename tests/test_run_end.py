"""The end of a `diloco run`: a syncer that never finishes its last rounds ends the run with an error that
says which one, where it stands and what its log last said (a hang at the end diagnosed from the error)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from diloco.errors import DilocoError
from diloco.launch.child_reports import unfinished_syncers
from diloco.launch.processes import Started
from diloco.v1 import diloco_pb2 as pb


@dataclass
class Answering:
    report: dict | None

    def status(self) -> pb.StatusReply:
        if self.report is None:
            raise DilocoError("syncer at 127.0.0.1:1 unavailable")
        return pb.StatusReply(finished=self.report["finished"], report_json=json.dumps(self.report))


def child(tmp_path, name: str, log: str) -> Started:
    path = tmp_path / f"{name}.log"
    path.write_text(log)
    return Started(name, [], {}, path)


def test_the_error_names_each_unfinished_syncer_where_it_stands_and_its_last_log_lines(tmp_path):
    done = {"finished": True, "joined": [0, 1], "left": [0, 1], "told_to_stop": True}
    stuck = {"finished": False, "joined": [2, 3], "left": [2], "told_to_stop": True, "left_upstream": False}
    message = unfinished_syncers([
        (child(tmp_path, "syncer-0", "fine\n"), Answering(done)),
        (child(tmp_path, "region-eu", "\n".join(f"line {i}" for i in range(20))), Answering(stuck)),
        (child(tmp_path, "region-us", ""), Answering(None))], waited_s=60)
    assert message.startswith("the syncer did not finish its last rounds within 60 s after every learner left")
    assert "syncer-0" not in message  # finished: not named
    assert "region-eu (joined [2, 3], left [2], told to stop: yes, left the global syncer: no)" in message
    assert "line 19" in message and "line 10" in message and "line 9\n" not in message  # its last ten lines
    assert "region-us does not answer (syncer at 127.0.0.1:1 unavailable)" in message
