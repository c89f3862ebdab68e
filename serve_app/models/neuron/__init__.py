"""The Neuron backend: the runner interface on NxD Inference (Trainium).

``spec.py`` and ``artifacts.py`` are plain Python (config -> NxDI arguments, artifact keys) and run
anywhere; ``sdk.py`` is the only module that imports the Neuron SDK, lazily; ``runner.py`` turns the
runner calls into NxDI forwards; ``serve_app/compile.py`` is ``python -m serve_app compile``.
"""
