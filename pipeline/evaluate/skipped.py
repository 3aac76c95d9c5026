"""What a run without a validation or a test set says it skipped, in one phrase each.

``data.val: null`` trains without validation loss: the pilot gate judges on
training loss (it always does; the report then also says there was no
validation loss to look at). ``data.test: null`` has no held-out prompts: the
smoke test proves the merged model loads and generates, and measures no exact
match. The pilot gate report, the smoke test's JSON and the summary pages
write these phrases verbatim (the workflow tests assert them), never a blank,
a NaN or a number that looks like a measurement.
"""

from __future__ import annotations

NO_VAL = "no validation set: validation loss skipped"
NO_TEST = "no test set: exact match skipped"
GATE_BASIS = "the pilot gate judges on training loss"
SKIPPED_KEY = "skipped"  # the key of a list of these phrases in pilot_report.json and smoke_test.json


def skipped_in(*reports: dict | None) -> list[str]:
    """The phrases the given reports (pilot_report.json, smoke_test.json; None: absent) record, in order."""
    found: list[str] = []
    for report in reports:
        for phrase in (report or {}).get(SKIPPED_KEY, []):
            if phrase not in found:
                found.append(phrase)
    return found
