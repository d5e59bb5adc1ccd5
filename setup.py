"""The native parts of KVSP: :mod:`kvsp._sha256x2`, the two §6.7 SHA-256 passes interleaved on
the x86 SHA extensions; :mod:`moqt._objscan`, MOQT object headers read in C;
:mod:`moqt._frozen`, cached payload slices the cyclic garbage collector does not walk; and
:mod:`moqt._tlsrecords`, QMux's TLS records decrypted in bulk off the GIL. All are optional:
where one cannot be built (no C compiler; for the first, not x86), the install goes on and the
Python path does the work (:mod:`kvsp.sha256x2` says so for hashing,
``moqt.objects.NATIVE_HEADERS`` for headers, :mod:`relay.cache` for slices,
:mod:`moqt.qmux_tls` for records). Everything
else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvsp._sha256x2",
            ["kvsp/_sha256x2.c"],
            optional=True,  # a failed build leaves the hashlib path, not a failed install
        ),
        Extension(
            "moqt._objscan",
            ["moqt/_objscan.c"],
            optional=True,  # a failed build leaves the Python reader of object headers
        ),
        Extension(
            "moqt._frozen",
            ["moqt/_frozen.c"],
            optional=True,  # a failed build leaves cached payloads as memoryviews
        ),
        Extension(
            "moqt._tlsrecords",
            ["moqt/_tlsrecords.c"],
            optional=True,  # a failed build leaves TLS records to SSLObject.read
        ),
    ]
)
