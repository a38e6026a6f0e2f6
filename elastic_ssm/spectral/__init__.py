"""elastic_ssm.spectral"""
