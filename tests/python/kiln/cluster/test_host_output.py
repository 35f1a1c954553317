"""What of its hosts' output a cluster job shows (no cluster needed): host 1+'s lines that only
repeat host 0's show once, as host 0's, and TensorStore's "no credentials" line not at all when
the store is a GCS emulator."""

from __future__ import annotations

import math

from kiln.cluster.driver import REPEAT_WINDOW_S, HostRepeats, JobDriver
from kiln.cluster.host import is_noise

ABSL_WARNING = "W1206 14:00:0{second}.053934    {thread} pjrt_client.cc:81] cpu client ready"
SIGTERM_LINE = "kiln: interrupted by SIGTERM after step 12; saved s3://b/x. Rerun to resume."
# What TensorStore 0.1.86 prints on a GCS request without credentials (before its path's end).
NO_CREDENTIALS = (
    "E1206 13:59:37.623082    1495 google_auth_provider.cc:188] Could not find the credentials "
    "file in the standard gcloud location [/home/kiln/.config/gcloud/application_default_"
    "credentials.json]. You may specify a credentials file using $GOOGLE_APPLICATION_CREDENTIALS"
)


def test_a_line_host_0_also_says_shows_once_whichever_comes_first() -> None:
    repeats = HostRepeats()
    first = [f"(host 0) {ABSL_WARNING.format(second=1, thread=11)}", f"(host 0) {SIGTERM_LINE}"]
    assert repeats.add(first, now=0.0) == first
    # Host 1 says both after host 0, with its own time and thread id: nothing more.
    later = [f"(host 1) {ABSL_WARNING.format(second=3, thread=42)}", f"(host 1) {SIGTERM_LINE}"]
    assert repeats.add(later, now=2.0) == []
    # Host 2 says it before host 0 (its batch came first): held, then dropped.
    repeats = HostRepeats()
    assert repeats.add([f"(host 2) {SIGTERM_LINE}"], now=0.0) == []
    assert repeats.add([f"(host 0) {SIGTERM_LINE}"], now=1.0) == [f"(host 0) {SIGTERM_LINE}"]
    assert repeats.due(math.inf) == []


def test_what_only_another_host_says_shows_after_the_window() -> None:
    repeats = HostRepeats()
    own = "(host 1) E1206 14:00:07.053934    7 coordination.cc:9] host 1 lost its peer"
    assert repeats.add(["kiln: a host of the run was lost", own], now=0.0) == [
        "kiln: a host of the run was lost"  # the driver's own: at once
    ]
    assert repeats.due(REPEAT_WINDOW_S / 2) == []
    assert repeats.add([], now=REPEAT_WINDOW_S) == [own]
    # A line host 0 said longer ago than the window is news again.
    repeats.add([f"(host 0) {SIGTERM_LINE}"], now=0.0)
    assert repeats.add([f"(host 1) {SIGTERM_LINE}"], now=REPEAT_WINDOW_S + 1) == []
    assert repeats.due(2 * REPEAT_WINDOW_S + 1) == [f"(host 1) {SIGTERM_LINE}"]


def test_the_job_output_drops_repeats_and_holds_the_rest_for_the_window() -> None:
    driver = JobDriver("job", {}, {})
    driver.write([f"(host 0) {SIGTERM_LINE}"])
    driver.write([f"(host 1) {SIGTERM_LINE}", "(host 1) kiln: host 1's own line"])
    assert driver.read(0)[0] == [f"(host 0) {SIGTERM_LINE}"]
    assert driver.status()["lines"] == 1  # host 1's own line is held, for up to the window


def test_tensorstore_without_credentials_is_noise_only_against_an_emulator() -> None:
    assert is_noise(NO_CREDENTIALS, emulated=True)
    assert not is_noise(NO_CREDENTIALS, emulated=False)  # against GCS: why requests fail
    assert not is_noise(ABSL_WARNING.format(second=1, thread=1), emulated=True)
