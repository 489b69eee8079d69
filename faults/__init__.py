"""Fault suite: the pipeline under steady load while its parts are killed, stalled or overrun
(`phaselens faults`); each scenario reports spans sent, acknowledged, stored, lost and duplicated,
client-side drops and the time to recover."""
