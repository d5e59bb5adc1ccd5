"""MOQT draft-ietf-moq-transport-16 on aioquic (ALPN ``moqt-16``), sans-I/O first."""
