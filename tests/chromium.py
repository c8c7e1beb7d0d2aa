"""Headless Chromium for the tests that render a page (report.html, the compare page): Debian's package,
started as the workplace's probe does (no sandbox as root, no background networking on a closed network)."""

from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                    reason="headless Chromium not installed (apt-get install -y chromium)")


def chromium_command(profile: Path, *extra: str) -> list[str]:
    """The command line up to the page: a fresh profile under `profile`, then `extra` flags."""
    return [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--hide-scrollbars", "--virtual-time-budget=5000", *extra]
