"""elastic_ssm.ops.spectral_scan"""
