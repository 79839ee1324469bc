"""The parts of `epp serve` besides the service's own lifecycle (`epp.app.EppService`):
its command line (`args`), where endpoints and the Lease come from (`sources`), and its
HTTP pages (`http`: /metrics, probes, debug pages)."""
