"""What the guest tells: the status fields and the status PUT's body (``report.py``, pure),
the task that sends it to the registry (``report_io.py``), the domain view collected from
``nvidia-imex-ctl`` and ``nvidia-smi`` (``collect.py``) and the status file
(``status_file.py``). May import the stages below (``pins`` and ``files``: what was
applied), the base modules and ``imex_shared``; never ``tls`` or ``imex``, its siblings.
"""
