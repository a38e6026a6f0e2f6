"""elastic_ssm.train"""
