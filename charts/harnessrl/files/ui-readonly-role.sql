-- The trace explorer's read-only role (psql; run by the owner of the store's tables, idempotent):
--   psql -v ON_ERROR_STOP=1 -v ui_role=harnessrl_ui -v ui_password=... -f ui-readonly-role.sql
-- It may read every table of schema public, those created later by migrations included (default privileges
-- of the role running this, which is the one that migrates), and every transaction it opens is read-only.
SELECT format('CREATE ROLE %I LOGIN', :'ui_role')
WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'ui_role') \gexec
ALTER ROLE :"ui_role" WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'ui_password';
ALTER ROLE :"ui_role" SET default_transaction_read_only = on;
SELECT format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), :'ui_role') \gexec
GRANT USAGE ON SCHEMA public TO :"ui_role";
GRANT SELECT ON ALL TABLES IN SCHEMA public TO :"ui_role";
ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO :"ui_role";
